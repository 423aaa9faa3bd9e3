"""`kvjax compare`: train every variant of an experiment with the same token budget, then measure cache
bytes (analytic and from a real cache after generation, which must agree), validation bits per byte and
decode speed, and write a table (CSV, JSON) and a plot of quality against KV bytes per token.

With `seeds: N` (`--seeds N`) each variant trains N times (train.seed, +1, ...: model init and data
order); the table gives the mean and a 95% Student-t interval of bits/byte, the plot error bars and
the Pareto front, and a summary says for each pair whether the intervals separate. With `lr_grid:`
(`--lr-grid`) each variant first trains briefly (`lr_steps`, default a quarter of the budget) at each
rate and keeps the one with the best bits/byte on validation windows the table does not report (the
CLA paper tunes per variant: orderings can depend on it). With `decode_contexts:` (`--decode-contexts`)
every trained model's decode speed is measured at each context after all training, alone, and plotted
against the context (`<name>-decode.png`). With `match_params: true` (`--match-params`) every variant's
`model.ffn_dim` is set so that its parameter count is the nearest to the first variant's (the
comparison at equal parameters as well as equal tokens). The JSON records the library versions, XLA flags and
device the numbers came from."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kvjax import memory
from kvjax.architectures.decoder import Decoder
from kvjax.cache import caches_nbytes
from kvjax.config import (
    CONFIG_ROOT,
    ConfigError,
    from_dict,
    load_config,
    load_yaml_tree,
)
from kvjax.report import format_bytes, format_table
from kvjax.timing import decode_seconds, decode_timings
from kvjax.training.distributed import is_primary
from kvjax.training.trainer import Trainer, prepare_corpus
from kvjax.training.uptrain_compare import UptrainExperiment


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """An experiment: variants (model configs), overrides shared by all (the equal training budget),
    extra overrides for --quick, and the decode-speed setting."""

    variants: tuple[str, ...] = ("mha", "gqa", "mqa", "swa")
    overrides: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    decode_batch: int = 8
    decode_context: int = 512
    decode_tokens: int = 32
    seeds: int = 1  # trainings per variant (train.seed, train.seed + 1, ...): model init and data order
    lr_grid: tuple[float, ...] = ()  # learning rates tried per variant on a short budget (the best is kept)
    lr_steps: int | None = None  # that budget (default: a quarter of train.steps)
    decode_contexts: tuple[int, ...] = ()  # contexts of the decode-speed curve (batch decode_batch), after training
    pairs: tuple[tuple[str, str], ...] = ()  # variant pairs whose intervals are compared (default: each vs the first)
    match_params: bool = False  # each variant's model.ffn_dim set so its parameters equal the first variant's

    def __post_init__(self):
        if not self.variants:
            raise ConfigError("variants=() must name at least one model config")
        if self.seeds < 1:
            raise ConfigError(f"seeds={self.seeds} must be >= 1")
        if any(c <= self.decode_tokens for c in self.decode_contexts):
            raise ConfigError(
                f"decode_contexts={list(self.decode_contexts)} must each exceed decode_tokens={self.decode_tokens}"
            )
        if any(lr <= 0 for lr in self.lr_grid) or (self.lr_steps is not None and self.lr_steps < 1):
            raise ConfigError(f"lr_grid={list(self.lr_grid)} must hold rates > 0 and lr_steps={self.lr_steps} be >= 1")
        for pair in self.pairs:
            if len(pair) != 2 or not set(pair) <= set(self.variants):
                raise ConfigError(f"pairs: {list(pair)} must be two of the variants {list(self.variants)}")
        for name in ("decode_batch", "decode_context", "decode_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.decode_tokens >= self.decode_context:
            raise ConfigError(f"decode_tokens={self.decode_tokens} must be < decode_context={self.decode_context}")


def load_experiment(name: str | Path | None = None):
    """An experiment YAML file, or a name under configs/experiments/ (default `compare`); `base:` inherits.
    A file naming `conversions` is an uptraining experiment (`training.uptrain_compare`)."""
    shipped = CONFIG_ROOT / "experiments"
    path = Path(name) if name else shipped / "compare.yaml"
    if not path.is_file() and (shipped / f"{name}.yaml").is_file():
        path = shipped / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in shipped.glob("*.yaml"))
        raise ConfigError(f"experiment {name!r} is neither a file nor a shipped experiment (shipped: {known})")
    tree = load_yaml_tree(path, shipped)
    return from_dict(UptrainExperiment if "conversions" in tree else CompareConfig, tree)


def count_params(cfg) -> int:
    """Parameters of a model config, from its abstract shapes (nothing allocated)."""
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    return int(sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param))))


def match_params(configs: dict) -> dict:
    """{variant: config} with every config after the first given the `model.ffn_dim` whose parameter
    count is nearest the first's. Parameters are affine in ffn_dim (each layer's FFN or RWKV channel mix
    has 2-3 matrices of d_model x ffn_dim), so two counts give the slope; a variant whose count does not
    depend on ffn_dim, or would need ffn_dim < 1, is an error."""
    (first, reference), *rest = configs.items()
    target = count_params(reference.model)
    out = {first: reference}
    for variant, cfg in rest:
        base = cfg.model.ffn_dim
        here = count_params(cfg.model)
        slope = (count_params(dataclasses.replace(cfg.model, ffn_dim=base + 8)) - here) / 8
        if slope == 0:
            raise ConfigError(
                f"match_params: {variant}'s parameters do not depend on model.ffn_dim, so they cannot "
                f"be matched to {first}'s {target:,}"
            )
        ffn = base + round((target - here) / slope)
        if ffn < 1:
            raise ConfigError(
                f"match_params: {variant} would need model.ffn_dim={ffn} (< 1) to have {first}'s {target:,} parameters"
            )
        out[variant] = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_dim=ffn))
    return out


@dataclasses.dataclass
class Row:
    variant: str
    params: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    cache_bytes_analytic: int
    cache_bytes_measured: int
    tokens_trained: int
    val_bpb: float  # the mean over seeds
    val_ppl: float
    decode_tokens_per_s: float  # the median of the timed rounds
    val_bpb_interval: float | None = None  # half-width of the 95% t-interval of the mean (None: one seed)
    val_bpb_seeds: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()
    lr: float = 0.0  # the learning rate trained with (the best of the grid, when there is one)
    lr_selection: dict = dataclasses.field(default_factory=dict)  # grid rate -> selection-split bits/byte
    decode_curve: dict = dataclasses.field(default_factory=dict)  # context -> decode tokens/s (batch decode_batch)
    ffn_dim: int = 0  # the variant's model.ffn_dim (set per variant with match_params)
    decode_tokens_per_s_rounds: tuple[float, ...] = ()  # each timed round (the table shows their spread)


def selection_windows(corpus, data) -> np.ndarray:
    """Validation windows after the `eval_windows` reported ones: what the LR grid selects by, so the
    reported score never picks a rate."""
    windows = corpus.val[data.eval_windows : 2 * data.eval_windows]
    if len(windows) == 0:
        raise ConfigError(
            f"the learning-rate grid selects on validation windows after the {data.eval_windows} "
            f"reported ones, and there are none ({len(corpus.val)} in all): lower data.eval_windows "
            "or raise data.val_fraction"
        )
    return windows


def short_budget(cfg, steps: int, lr: float):
    """`cfg` trained for `steps` at `lr`, its warmup and evaluation scaled to the shorter run."""
    t = cfg.train
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            t, steps=steps, lr=lr, warmup_steps=t.warmup_for(steps), eval_every=steps, checkpoint_every=steps
        ),
    )


def pick_lr(cfg, exp, corpus, out_dir: Path, log) -> tuple[float, dict]:
    """Train `cfg` briefly at each rate of the grid; (the rate with the lowest bits/byte on the selection
    split, {rate: bits/byte})."""
    steps = exp.lr_steps or max(1, cfg.train.steps // 4)
    selection = selection_windows(corpus, cfg.data)
    scores = {}
    for lr in exp.lr_grid:
        trainer = Trainer(
            short_budget(cfg, steps, lr), out_dir / "lr-grid" / f"{cfg.model.name}-lr{lr:g}", corpus=corpus
        )
        trainer.run()
        scores[lr] = float(trainer.evaluate(selection)["eval_bpb"])
    best = min(scores, key=scores.get)
    log(
        f"    learning rate {best:g} (selection bits/byte: "
        + ", ".join(f"{lr:g} {bpb:.3f}" for lr, bpb in scores.items())
        + ")"
    )
    return best, scores


def mean_interval(values, level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the two-sided Student-t interval of the mean at `level`); 0 for one value."""
    from scipy import stats

    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return float(x.mean()), 0.0
    half = stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return float(x.mean()), float(half)


def separation(rows: list[Row], pairs) -> list[tuple[str, str, str]]:
    """(a, b, verdict) for each pair (default: every variant against the first): 'separated' when the
    two 95% intervals do not overlap, 'not separated' when they do, 'one seed' without intervals."""
    by = {r.variant: r for r in rows}
    pairs = pairs or [(rows[0].variant, r.variant) for r in rows[1:]]
    out = []
    for a, b in pairs:
        ra, rb = by[a], by[b]
        if len(ra.val_bpb_seeds) < 2 or len(rb.val_bpb_seeds) < 2:
            out.append((a, b, "one seed"))
            continue
        apart = abs(ra.val_bpb - rb.val_bpb) > ra.val_bpb_interval + rb.val_bpb_interval
        out.append((a, b, "separated" if apart else "not separated"))
    return out


def environment() -> dict:
    """What a run's numbers depend on beyond its config: library versions, XLA flags, the device."""
    import os
    import platform

    import flax
    import jaxlib
    import optax

    device = jax.devices()[0]
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "machine": platform.machine(),
    }


def decode_curve(model, stream: np.ndarray, exp: CompareConfig, repeats: int) -> dict[int, float]:
    """Decode tokens/s at each of the experiment's `decode_contexts` (batch `decode_batch`): prompts cut
    from a token stream (repeated as needed) that, with `decode_tokens` new tokens, fill the context."""
    curve = {}
    for context in exp.decode_contexts:
        prompts = np.resize(stream, (exp.decode_batch, context - exp.decode_tokens))
        seconds, _ = decode_seconds(model, prompts, exp.decode_tokens, repeats)
        curve[context] = exp.decode_batch * exp.decode_tokens / seconds
    return curve


def run_compare(
    exp: CompareConfig,
    out_dir: str | Path,
    *,
    quick: bool = False,
    name: str = "compare",
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Train (or reuse, when a finished run with the same config is there) every variant under
    out_dir/<variant>, measure it (decode speed: the median of 5 timed rounds, 1 with `quick`), and
    write out_dir/<name>.{csv,json,png}. Over several processes the training is shared and every process
    measures its own whole copy of each model (on one host's devices); process 0 writes."""
    out_dir = Path(out_dir)
    overrides = [*exp.overrides, *(exp.quick if quick else ())]
    configs = {v: load_config(v, overrides) for v in exp.variants}  # every config is checked before training
    data_configs = {c.data for c in configs.values()}
    if len(data_configs) != 1:
        raise ConfigError("all variants of a comparison must share one data config (the same corpus and budget)")
    unmatched = configs
    if exp.match_params:
        configs = match_params(configs)
    corpus = prepare_corpus(next(iter(configs.values())))
    rows, models = [], []
    for i, (variant, cfg) in enumerate(configs.items(), 1):
        base_lr, lr_scores = cfg.train.lr, {}
        if exp.lr_grid:
            log(f"[{i}/{len(configs)}] {variant}: learning-rate grid {', '.join(f'{lr:g}' for lr in exp.lr_grid)}")
            lr, lr_scores = pick_lr(cfg, exp, corpus, out_dir, log)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=lr))
        run_name = variant + ("" if cfg.model == unmatched[variant].model else f"-ffn{cfg.model.ffn_dim}")
        run_name += "" if cfg.train.lr == base_lr else f"-lr{cfg.train.lr:g}"
        seeds = [cfg.train.seed + s for s in range(exp.seeds)]
        scores, model = [], None
        for seed in seeds:  # the first seed's run is the variant's own directory (reused across experiments)
            run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
            where = out_dir / (run_name if seed == cfg.train.seed else f"{run_name}-seed{seed}")
            trainer = Trainer(run_cfg, where, corpus=corpus)
            steps, which = cfg.train.steps, f" (seed {seed})" if exp.seeds > 1 else ""
            if trainer.step >= steps:
                log(f"[{i}/{len(configs)}] {variant}{which}: reusing the finished run in {where} ({steps} steps)")
            else:
                resume = f", resuming at step {trainer.step}" if trainer.step else ""
                log(
                    f"[{i}/{len(configs)}] {variant}{which}: training {steps} steps of {cfg.train.batch_size} x "
                    f"{cfg.data.seq_len} tokens{resume}"
                )
            trainer.run()
            scores.append(trainer.evaluate())
            model = model or trainer.model()  # speed and bytes: the first seed's model
        bpb, interval = mean_interval([sc["eval_bpb"] for sc in scores])
        prompt_len = exp.decode_context - exp.decode_tokens
        prompts = np.resize(corpus.val[:, :prompt_len], (exp.decode_batch, prompt_len))
        decode_s, caches = decode_timings(model, prompts, exp.decode_tokens, repeats=1 if quick else 5)
        rounds = tuple(exp.decode_batch * exp.decode_tokens / s for s in decode_s)
        tok_s = float(np.median(rounds))
        analytic = memory.cache_bytes(cfg.model, exp.decode_context, exp.decode_batch)
        measured = caches_nbytes(caches)
        if measured != analytic:
            raise AssertionError(f"{variant}: measured cache bytes {measured} != analytic {analytic}")
        row = Row(
            variant=variant,
            params=count_params(cfg.model),
            kv_bytes_per_token=memory.kv_bytes_per_token(cfg.model),
            state_bytes_per_sequence=memory.state_bytes_per_sequence(cfg.model),
            cache_bytes_analytic=analytic,
            cache_bytes_measured=measured,
            tokens_trained=cfg.train.steps * cfg.train.batch_size * cfg.data.seq_len,
            val_bpb=bpb,
            val_ppl=float(np.mean([sc["eval_ppl"] for sc in scores])),
            decode_tokens_per_s=tok_s,
            decode_tokens_per_s_rounds=rounds,
            val_bpb_interval=interval if exp.seeds > 1 else None,
            val_bpb_seeds=tuple(float(sc["eval_bpb"]) for sc in scores),
            seeds=tuple(seeds),
            lr=cfg.train.lr,
            lr_selection=lr_scores,
            ffn_dim=cfg.model.ffn_dim,
        )
        models.append(model)
        spread = f" +- {interval:.3f}" if exp.seeds > 1 else ""
        log(f"    bits/byte {row.val_bpb:.3f}{spread}, cache {format_bytes(measured)}, decode {tok_s:,.0f} tokens/s")
        rows.append(row)
    if exp.decode_contexts:  # every model alone, after all training, so nothing else competes for the CPU
        log(f"decode speed at {', '.join(map(str, exp.decode_contexts))} tokens (batch {exp.decode_batch})")
        stream = corpus.val.reshape(-1)
        for row, model in zip(rows, models):
            row.decode_curve.update(decode_curve(model, stream, exp, repeats=1 if quick else 3))
            log(f"  {row.variant}: " + ", ".join(f"{c} {t:,.0f}" for c, t in row.decode_curve.items()) + " tokens/s")
    if is_primary():
        write_outputs(rows, exp, out_dir, name)
    log(render(rows, exp))
    if exp.seeds > 1:
        log("\n95% intervals of validation bits/byte over " + f"{exp.seeds} seeds:")
        for a, b, verdict in separation(rows, exp.pairs):
            log(f"  {a} vs {b}: {verdict}")
    log(f"\nwrote {out_dir}/{name}.csv, {name}.json and {name}.png")
    return rows


def render(rows: list[Row], exp: CompareConfig) -> str:
    ctx = f"@{exp.decode_context} x{exp.decode_batch}"
    headers = [
        "variant",
        "params",
        "KV B/token",
        "state B/seq",
        f"cache {ctx} (analytic)",
        "(measured)",
        "val bits/byte",
        "val ppl",
        "decode tok/s",
    ]
    if exp.seeds > 1:
        headers[6] = f"val bits/byte ({exp.seeds} seeds, 95%)"
    if exp.lr_grid:
        headers.append("lr (grid)")
    if exp.match_params:  # the FFN widths differ only when matched
        headers.insert(2, "ffn")
    body = [
        [
            r.variant,
            f"{r.params:,}",
            *([r.ffn_dim] if exp.match_params else []),
            r.kv_bytes_per_token,
            r.state_bytes_per_sequence,
            format_bytes(r.cache_bytes_analytic),
            format_bytes(r.cache_bytes_measured),
            f"{r.val_bpb:.4f}" + (f" +- {r.val_bpb_interval:.4f}" if exp.seeds > 1 else ""),
            f"{r.val_ppl:.3f}",
            speed(r.decode_tokens_per_s_rounds),
            *([f"{r.lr:g}"] if exp.lr_grid else []),
        ]
        for r in rows
    ]
    return format_table(headers, body)


def speed(rounds: tuple[float, ...]) -> str:
    """A timing's median with its spread across rounds (half the range, % of the median); one round is
    marked as indicative."""
    median = float(np.median(rounds))
    if len(rounds) < 2:
        return f"~{median:,.0f} (1 round)"
    return f"{median:,.0f} +-{50 * (max(rounds) - min(rounds)) / median:.0f}%"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (bytes, bits/byte) no other point beats on both, by increasing bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def front_line(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The Pareto front as a staircase (steps-post) that runs on to the largest cache: nothing there beats
    the front, and a front of one point is still a line the legend can show."""
    front = pareto_front(points)
    xs, ys = [points[i][0] for i in front], [points[i][1] for i in front]
    return [*xs, max(x for x, _ in points)], [*ys, ys[-1]]


def write_outputs(rows: list[Row], exp: CompareConfig, out_dir: Path, name: str = "compare") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    scalars = [
        {k: "n/a" if v is None else v for k, v in r.items() if not isinstance(v, tuple | list | dict)} for r in records
    ]
    with open(out_dir / f"{name}.csv", "w", newline="") as f:  # per-seed and grid scores: in the JSON
        writer = csv.DictWriter(f, fieldnames=list(scalars[0]))
        writer.writeheader()
        writer.writerows(scalars)
    (out_dir / f"{name}.json").write_text(
        json.dumps({"experiment": dataclasses.asdict(exp), "environment": environment(), "rows": records}, indent=2)
    )
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    points = [(r.cache_bytes_analytic / (exp.decode_batch * exp.decode_context), r.val_bpb) for r in rows]
    right = max(x for x, _ in points)
    for r, (per_token, bpb) in zip(rows, points):
        ax.errorbar(per_token, bpb, yerr=r.val_bpb_interval or None, fmt="o", ms=6, capsize=3)
        flip = per_token >= right / 2 and per_token > min(x for x, _ in points)  # labels point inwards
        ax.annotate(
            r.variant,
            (per_token, bpb),
            textcoords="offset points",
            xytext=(-5 if flip else 5, 5),
            ha="right" if flip else "left",
            fontsize=8,
        )
    xs, ys = front_line(points)
    ax.plot(
        xs,
        ys,
        drawstyle="steps-post",
        color="grey",
        alpha=0.6,
        marker="D",
        ms=9,
        mfc="none",
        markevery=list(range(len(pareto_front(points)))),
        label="Pareto front",
        zorder=0,
    )
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.margins(x=0.12, y=0.12)
    ax.set_xlabel(f"cache bytes per token at a {exp.decode_context}-token context (all layers)")
    ax.set_ylabel("validation bits per byte (lower is better)")
    seeds = f", mean and 95% interval of {exp.seeds} seeds" if exp.seeds > 1 else ""
    ax.set_title(f"Quality vs KV memory ({rows[0].tokens_trained:,} training tokens each{seeds})", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png")
    plt.close(fig)
    if rows[0].decode_curve:
        plot_decode_curves({r.variant: r.decode_curve for r in rows}, exp.decode_batch, out_dir / f"{name}-decode.png")


def plot_decode_curves(curves: dict[str, dict[int, float]], batch: int, path: Path) -> None:
    """Decode tokens/s against context length, one line per variant, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for variant, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"decode tokens/s (batch {batch})")
    ax.set_title("Decode speed against context: what bytes per token predict", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

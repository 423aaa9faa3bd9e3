"""`kvjax compare`: train every variant of an experiment with the same token budget, then measure cache
bytes (analytic and from a real cache after generation, which must agree), validation bits per byte and
decode speed, and write a table (CSV, JSON) and a plot of quality against KV bytes per token."""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kvjax import memory
from kvjax.cache import caches_nbytes
from kvjax.config import CONFIG_ROOT, ConfigError, DecodingConfig, from_dict, load_config, load_yaml_tree
from kvjax.generate import Generator
from kvjax.report import format_bytes, format_table
from training.trainer import Trainer, prepare_corpus


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

    def __post_init__(self):
        if not self.variants:
            raise ConfigError("variants=() must name at least one model config")
        for name in ("decode_batch", "decode_context", "decode_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.decode_tokens >= self.decode_context:
            raise ConfigError(f"decode_tokens={self.decode_tokens} must be < decode_context={self.decode_context}")


def load_experiment(name: str | Path | None = None):
    """An experiment YAML file, or a name under configs/experiments/ (default `compare`); `base:` inherits.
    A file naming `conversions` is an uptraining experiment (`training.uptrain_compare`)."""
    from training.uptrain_compare import UptrainExperiment

    shipped = CONFIG_ROOT / "experiments"
    path = Path(name) if name else shipped / "compare.yaml"
    if not path.is_file() and (shipped / f"{name}.yaml").is_file():
        path = shipped / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in shipped.glob("*.yaml"))
        raise ConfigError(f"experiment {name!r} is neither a file nor a shipped experiment (shipped: {known})")
    tree = load_yaml_tree(path, shipped)
    return from_dict(UptrainExperiment if "conversions" in tree else CompareConfig, tree)


@dataclasses.dataclass
class Row:
    variant: str
    params: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    cache_bytes_analytic: int
    cache_bytes_measured: int
    tokens_trained: int
    val_bpb: float
    val_ppl: float
    decode_tokens_per_s: float


def generation_times(model, prompts: np.ndarray, new_tokens: int, repeats: int = 5) -> tuple[float, float, tuple]:
    """(prefill seconds, greedy decode seconds, final caches) for a batch of prompts that, with the new
    tokens, fill the cache; each phase timed separately, the median of `repeats` rounds after one that
    compiles and warms up. The decode samples `new_tokens` tokens with `new_tokens - 1` forward steps."""
    gen = Generator(model, capacity=prompts.shape[1] + new_tokens)
    decoding = DecodingConfig(max_new_tokens=new_tokens)
    tokens, lengths = gen.pad(prompts.tolist(), new_tokens)
    rng = jax.random.key(0)
    prefills, decodes = [], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        logits, caches = jax.block_until_ready(gen.prefill(tokens, lengths))
        prefills.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = gen.decode(caches, logits, lengths, decoding, rng)
        jax.block_until_ready(result.caches)
        decodes.append(time.perf_counter() - start)
    return float(np.median(prefills[1:])), float(np.median(decodes[1:])), result.caches


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
    write out_dir/<name>.{csv,json,png}."""
    out_dir = Path(out_dir)
    overrides = [*exp.overrides, *(exp.quick if quick else ())]
    configs = {v: load_config(v, overrides) for v in exp.variants}  # every config is checked before training
    data_configs = {c.data for c in configs.values()}
    if len(data_configs) != 1:
        raise ConfigError("all variants of a comparison must share one data config (the same corpus and budget)")
    corpus = prepare_corpus(next(iter(configs.values())))
    rows = []
    for i, (variant, cfg) in enumerate(configs.items(), 1):
        trainer = Trainer(cfg, out_dir / variant, corpus=corpus)
        steps, where = cfg.train.steps, out_dir / variant
        if trainer.step >= steps:
            log(f"[{i}/{len(configs)}] {variant}: reusing the finished run in {where} ({steps} steps)")
        else:
            resume = f", resuming at step {trainer.step}" if trainer.step else ""
            log(f"[{i}/{len(configs)}] {variant}: training {steps} steps of {cfg.train.batch_size} x "
                f"{cfg.data.seq_len} tokens{resume}")
        trainer.run()
        scores = trainer.evaluate()
        model = trainer.model()
        n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
        prompt_len = exp.decode_context - exp.decode_tokens
        prompts = np.resize(corpus.val[:, :prompt_len], (exp.decode_batch, prompt_len))
        _, decode_s, caches = generation_times(model, prompts, exp.decode_tokens, repeats=1 if quick else 5)
        tok_s = exp.decode_batch * exp.decode_tokens / decode_s
        analytic = memory.cache_bytes(cfg.model, exp.decode_context, exp.decode_batch)
        measured = caches_nbytes(caches)
        if measured != analytic:
            raise AssertionError(f"{variant}: measured cache bytes {measured} != analytic {analytic}")
        row = Row(
            variant=variant,
            params=int(n_params),
            kv_bytes_per_token=memory.kv_bytes_per_token(cfg.model),
            state_bytes_per_sequence=memory.state_bytes_per_sequence(cfg.model),
            cache_bytes_analytic=analytic,
            cache_bytes_measured=measured,
            tokens_trained=cfg.train.steps * cfg.train.batch_size * cfg.data.seq_len,
            val_bpb=float(scores["eval_bpb"]),
            val_ppl=float(scores["eval_ppl"]),
            decode_tokens_per_s=float(tok_s),
        )
        log(f"    bits/byte {row.val_bpb:.3f}, cache {format_bytes(measured)}, decode {tok_s:,.0f} tokens/s")
        rows.append(row)
    write_outputs(rows, exp, out_dir, name)
    log(render(rows, exp))
    log(f"\nwrote {out_dir}/{name}.csv, {name}.json and {name}.png")
    return rows


def render(rows: list[Row], exp: CompareConfig) -> str:
    ctx = f"@{exp.decode_context} x{exp.decode_batch}"
    headers = ["variant", "params", "KV B/token", "state B/seq", f"cache {ctx} (analytic)", "(measured)",
               "val bits/byte", "val ppl", "decode tok/s"]
    body = [
        [r.variant, f"{r.params:,}", r.kv_bytes_per_token, r.state_bytes_per_sequence, format_bytes(r.cache_bytes_analytic),
         format_bytes(r.cache_bytes_measured), f"{r.val_bpb:.4f}", f"{r.val_ppl:.3f}", f"{r.decode_tokens_per_s:,.0f}"]
        for r in rows
    ]
    return format_table(headers, body)


def write_outputs(rows: list[Row], exp: CompareConfig, out_dir: Path, name: str = "compare") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    (out_dir / f"{name}.json").write_text(json.dumps({"experiment": dataclasses.asdict(exp), "rows": records}, indent=2))
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for r in rows:
        per_token = r.cache_bytes_analytic / (exp.decode_batch * exp.decode_context)
        ax.scatter(per_token, r.val_bpb, s=40)
        ax.annotate(r.variant, (per_token, r.val_bpb), textcoords="offset points", xytext=(5, 5))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"cache bytes per token at a {exp.decode_context}-token context (all layers)")
    ax.set_ylabel("validation bits per byte (lower is better)")
    ax.set_title(f"Quality vs KV memory ({rows[0].tokens_trained:,} training tokens each)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png")
    plt.close(fig)

"""`kvjax compare --experiment uptrain`: a source model, each conversion of it right after converting and
after uptraining, and (for a source trained here) the same target trained from scratch on as many
tokens as the source and its uptraining saw together: the GQA paper's uptrain-vs-scratch comparison
(Ainslie et al. 2023, sec. 3.3), with KV bytes per token, validation NLL and decode speed per row.

An experiment file names `source` (a model config trained here first, or a model reference such as
`smollm2`), `conversions`, `source_overrides` (the source's training), `uptrain_overrides` (each
uptraining's), `quick` overrides for a smoke test, and the decode-speed setting. Every run lives under
the output directory and is reused when finished.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvjax import memory
from kvjax.config import CONFIG_ROOT, ConfigError, load_config
from kvjax.report import format_table
from kvjax.timing import decode_seconds
from kvjax.training.convert import parse_conversion
from kvjax.training.distributed import is_primary
from kvjax.training.loading import load_model
from kvjax.training.trainer import Trainer, evaluate_model, prepare_corpus
from kvjax.training.uptrain import converted_model, uptrain


@dataclasses.dataclass(frozen=True)
class UptrainExperiment:
    source: str = "mha"
    conversions: tuple[str, ...] = ("mqa", "cla2")
    source_overrides: tuple[str, ...] = ()
    uptrain_overrides: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()  # applied to the source's and every uptraining's config
    scratch: bool = True  # also train each target from scratch (sources trained here only)
    decode_batch: int = 8
    decode_context: int = 512
    decode_tokens: int = 32

    def __post_init__(self):
        if not self.conversions:
            raise ConfigError("conversions=() must name at least one conversion (e.g. mqa, cla2)")
        for text in self.conversions:
            parse_conversion(text)
        for name in ("decode_batch", "decode_context", "decode_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")


@dataclasses.dataclass
class UptrainRow:
    model: str
    kv_bytes_per_token: int
    tokens_trained: int  # by the uptraining (after the source's), or in all (from scratch)
    val_nll: float
    val_bpb: float
    decode_tokens_per_s: float


def run_uptrain_compare(
    exp: UptrainExperiment,
    out_dir: str | Path,
    *,
    quick: bool = False,
    name: str = "uptrain",
    log: Callable[[str], None] = print,
) -> list[UptrainRow]:
    """Train the source (when it is a model config), uptrain every conversion, train the scratch
    baselines, score every model on the same validation windows, write out_dir/<name>.json and print
    the table."""
    out_dir = Path(out_dir)
    extra = list(exp.quick if quick else ())
    from_config = (CONFIG_ROOT / "models" / f"{exp.source}.yaml").is_file() or exp.source.endswith(".yaml")
    source_ref = str(out_dir / "source") if from_config else exp.source
    if from_config:
        source_cfg = load_config(exp.source, [*exp.source_overrides, *extra])
        log(f"source {exp.source}: training {source_cfg.train.steps} steps in {source_ref}")
        Trainer(source_cfg, source_ref).run()
    loaded = load_model(source_ref)
    runs = {}
    for conversion in exp.conversions:
        run_dir = out_dir / re.sub(r"[^A-Za-z0-9.-]+", "_", conversion)
        log(f"{conversion}: uptraining in {run_dir}")
        runs[conversion] = (
            run_dir,
            uptrain(source_ref, conversion, run_dir, [*exp.uptrain_overrides, *extra], log=log),
        )
    first = load_model(str(next(iter(runs.values()))[0]))
    val = prepare_corpus(first.config).val[: first.config.data.eval_windows]  # the windows every row is scored on

    def scored(label: str, model, kv: int, tokens: int) -> UptrainRow:
        scores = evaluate_model(model, val, first.tokenizer, first.config.train.batch_size)
        prompt_len = exp.decode_context - exp.decode_tokens
        prompts = np.resize(val[:, :prompt_len], (exp.decode_batch, prompt_len))
        seconds, _ = decode_seconds(model, prompts, exp.decode_tokens, repeats=1 if quick else 3)
        return UptrainRow(
            label, kv, tokens, scores["eval_loss"], scores["eval_bpb"], exp.decode_batch * exp.decode_tokens / seconds
        )

    rows = [scored(f"{exp.source} (source)", loaded.model, memory.kv_bytes_per_token(loaded.config.model), 0)]
    for conversion, (run_dir, record) in runs.items():
        up = load_model(str(run_dir))
        kv = memory.kv_bytes_per_token(up.config.model)
        rows.append(scored(f"{conversion}, converted", converted_model(loaded, parse_conversion(conversion)), kv, 0))
        rows.append(scored(f"{conversion}, uptrained", up.model, kv, record["tokens"]))
        if exp.scratch and from_config:  # the target from scratch, on the source's plus the uptraining's tokens
            src, per_step = loaded.config, up.config.train.batch_size * up.config.data.seq_len
            total = src.train.steps * src.train.batch_size * src.data.seq_len + record["tokens"]
            scratch_cfg = dataclasses.replace(
                up.config,
                train=dataclasses.replace(
                    src.train, steps=-(-total // per_step), batch_size=up.config.train.batch_size
                ),
            )
            scratch_dir = run_dir.with_name(run_dir.name + "-scratch")
            log(f"{conversion}: training from scratch for {scratch_cfg.train.steps} steps in {scratch_dir}")
            trainer = Trainer(scratch_cfg, scratch_dir)
            trainer.run()
            tokens = scratch_cfg.train.steps * scratch_cfg.train.batch_size * scratch_cfg.data.seq_len
            rows.append(scored(f"{conversion}, from scratch", trainer.model(), kv, tokens))
    if is_primary():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(
            json.dumps({"experiment": dataclasses.asdict(exp), "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)
        )
    log(render(rows, exp))
    log(f"\nwrote {out_dir}/{name}.json")
    return rows


def render(rows: list[UptrainRow], exp: UptrainExperiment) -> str:
    headers = [
        "model",
        "KV B/token",
        "tokens trained",
        "val NLL (nats/token)",
        "bits/byte",
        f"decode tok/s @{exp.decode_context} x{exp.decode_batch}",
    ]
    return format_table(
        headers,
        [
            [
                r.model,
                f"{r.kv_bytes_per_token:,}",
                f"{r.tokens_trained:,}",
                f"{r.val_nll:.4f}",
                f"{r.val_bpb:.4f}",
                f"{r.decode_tokens_per_s:,.0f}",
            ]
            for r in rows
        ],
    )

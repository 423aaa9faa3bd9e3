"""Uptraining (Ainslie et al. 2023, sec. 2.1): convert a pretrained model to another KV architecture
(`training.convert`), then continue training it briefly with the usual trainer, and measure how much
of the source's quality the conversion lost and the training recovered.

The run directory is an ordinary run (config.yaml, checkpoints, metrics.jsonl: `kvjax train DIR`
resumes it, `kvjax eval/generate DIR` read it) plus `uptrain.json`: the source, the conversion, the
validation scores of the source, of the converted model before training and after it, the KV bytes
per token of both, and the context the source was trained on (which the converted model keeps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

from kvjax import memory
from kvjax.config import (
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    resolve_config_path,
)
from kvjax.training.compression_eval import calibration_tokens
from kvjax.training.convert import Conversion, conversion_for, convert, parse_conversion
from kvjax.training.distributed import is_primary
from kvjax.training.hf_import import is_hf_dir
from kvjax.training.loading import is_gguf, load_model
from kvjax.training.trainer import Trainer, evaluate_model
from kvjax.training.vocab import GGUF_PREFIX, HF_PREFIX

RECORD = "uptrain.json"
# An imported (GGUF or Hugging Face) source's defaults: a short run at a small learning rate, as
# MHA2MLA's recipe (AdamW lr 1e-4, no weight decay) fine-tunes pretrained weights; override any of them.
# One checkpoint kept: a SmolLM2-135M checkpoint (fp32 parameters and Adam's two moments) is 1.4 GB
# (`kvjax uptrain smollm2 mqa train.steps=5`, then `du -sh` of the run's checkpoints/).
IMPORTED_DEFAULTS = (
    "data.seq_len=256",
    "data.eval_windows=32",
    "train.steps=100",
    "train.batch_size=4",
    "train.lr=1e-4",
    "train.warmup_steps=10",
    "train.weight_decay=0.0",
    "train.eval_every=100",
    "train.checkpoint_every=50",
    "train.keep_checkpoints=1",
)


def uptrain_config(source_ref: str, loaded, target_model, overrides: list[str]) -> Config:
    """The run's config: the converted model, and the source run's data and training settings (for an
    imported source, its own tokenizer and `IMPORTED_DEFAULTS`), with `overrides` on top. A given
    train.steps without train.warmup_steps keeps the warm-up's fraction of the run."""
    if models := [o for o in overrides if o.startswith("model.")]:
        raise ConfigError(f"{models}: the model is the converted source; change it through the conversion")
    base = dataclasses.replace(loaded.config, model=target_model).to_dict()
    if imported := (GGUF_PREFIX if is_gguf(source_ref) else HF_PREFIX if is_hf_dir(source_ref) else None):
        base["data"]["tokenizer"] = imported + source_ref
        base["data"]["corpus"] = loaded.corpus
        base = apply_overrides(base, IMPORTED_DEFAULTS)
    tree = apply_overrides(base, overrides)
    given = {o.partition("=")[0] for o in overrides}
    if "train.steps" in given and "train.warmup_steps" not in given and isinstance(tree["train"]["steps"], int):
        default = from_dict(Config, base).train
        tree["train"]["warmup_steps"] = default.warmup_for(tree["train"]["steps"])
    return from_dict(Config, tree)


def _conversion_or_config(text: str):
    """A conversion spec, or else the model config a YAML path or shipped name gives (a ModelConfig)."""
    try:
        return parse_conversion(text)
    except ConfigError as bad_spec:
        try:
            resolve_config_path(text)
        except ConfigError:
            raise bad_spec from None
        return load_config(text).model


def converted_model(loaded, spec):
    """`loaded.model` converted by `spec`; MHA2MLA's 2-norm rule calibrates on the source's corpus."""
    calibration = None
    if spec.mla_rank is not None and spec.mla_select == "norm":
        spec.target(loaded.config.model)  # refusals before reading the corpus
        calibration = calibration_tokens(loaded.tokenizer, loaded.corpus, rows=8, length=128)
    return convert(loaded.model, spec, calibration)


def _write(path: Path, record: dict) -> None:
    """Atomically: a crash leaves the old record or the new one, never half of one. Process 0's only."""
    if not is_primary():
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def uptrain(
    source_ref: str,
    conversion: str,
    run_dir: str | Path,
    overrides: list[str] = (),
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    stop_at: int | None = None,
) -> dict:
    """Convert `source_ref` (a run directory, a .gguf file or a shipped name) by `conversion`, train it
    in `run_dir` (resuming it when it exists; stopping early at `stop_at`, as an interruption would)
    and return the run's record (see the module docstring)."""
    spec = _conversion_or_config(conversion)  # bad text fails before anything loads
    loaded = load_model(source_ref)
    if not isinstance(spec, Conversion):  # a target model config: the conversion that reaches it
        spec = conversion_for(loaded.config.model, spec, conversion)
    converted = converted_model(loaded, spec)
    config = uptrain_config(source_ref, loaded, converted.config, list(overrides))
    run_dir = Path(run_dir)
    path = run_dir / RECORD
    record = json.loads(path.read_text()) if path.is_file() else None
    if record is not None and (record["source"], record["conversion"]) != (source_ref, conversion):
        raise ConfigError(
            f"{run_dir} uptrains {record['source']} by {record['conversion']!r}, not "
            f"{source_ref} by {conversion!r}; choose another --run-dir"
        )
    trainer = Trainer(config, run_dir, progress=progress, init=converted)
    if record is None:
        val = trainer.corpus.val[: config.data.eval_windows]
        log(f"evaluating {source_ref} and its conversion ({conversion}) on {len(val)} validation windows")
        record = {
            "source": source_ref,
            "conversion": conversion,
            "context": loaded.context,
            "kv_bytes_per_token": {
                "source": memory.kv_bytes_per_token(loaded.config.model),
                "converted": memory.kv_bytes_per_token(config.model),
            },
            "source_eval": evaluate_model(loaded.model, val, trainer.corpus.tokenizer, config.train.batch_size),
            "before": trainer.evaluate(),
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        _write(path, record)
    start = time.perf_counter()
    log(f"uptraining {config.model.name} in {run_dir} from step {trainer.step} of {config.train.steps}")
    history = trainer.run(stop_at=stop_at)
    seconds = time.perf_counter() - start if history else 0.0  # a finished run resumed trains nothing
    record["after"] = {"step": trainer.step, **trainer.final_scores(history)}
    record["tokens"] = trainer.step * config.train.batch_size * config.data.seq_len
    record["train_seconds"] = record.get("train_seconds", 0.0) + seconds
    _write(path, record)
    return record

"""`kvjax train`: train a model config, or resume or extend a run directory."""

from __future__ import annotations

import json
from pathlib import Path

from kvjax.commands.args import check_output, split_overrides
from kvjax.errors import ConfigError


def _train_target(names: list[str], overrides: list[str], run_dir: str | None):
    """(config, run directory) of `kvjax train`: a model config (+ --run-dir), or a run directory,
    resumed with the config it was started with (its config.yaml, or for a run made before those were
    written, its latest checkpoint's record), overrides applied on top."""
    from kvjax.config import Config, apply_overrides, from_dict, load_config
    from kvjax.training.checkpoint import Checkpointer
    from kvjax.training.trainer import RUN_CONFIG

    if len(names) != 1:
        raise ConfigError(f"kvjax train needs exactly one config or run directory, got {names}")
    given = Path(names[0])
    if not (given / RUN_CONFIG).is_file() and not (given / "checkpoints").is_dir():
        config = load_config(names[0], overrides)
        return config, Path(run_dir or f"runs/{config.model.name}")
    if run_dir is not None and Path(run_dir).resolve() != given.resolve():
        raise ConfigError(f"--run-dir={run_dir} differs from the run directory {names[0]} being resumed")
    if (given / RUN_CONFIG).is_file():
        return load_config(given / RUN_CONFIG, overrides), given
    _, record = Checkpointer(given / "checkpoints", create=False).read_record()
    return from_dict(Config, apply_overrides(record["config"], overrides)), given


def run(args) -> None:
    from kvjax.training.trainer import Trainer

    names, overrides = split_overrides(args.config)
    config, run_dir = _train_target(names, overrides, args.run_dir)
    check_output(run_dir, "--run-dir", directory=True)
    trainer = Trainer(config, run_dir)
    steps = config.train.steps
    if trainer.extended_from is not None:
        print(
            f"train.steps {trainer.extended_from} -> {steps}: the learning-rate schedule now decays over {steps} steps"
        )
    done = " (finished: nothing to train)" if trainer.step >= steps else ""
    print(f"training {config.model.name} in {run_dir} from step {trainer.step} of {steps}{done}")
    history = trainer.run(log=lambda row: print(json.dumps(row), flush=True) if "eval_loss" in row else None)
    print(json.dumps({"step": trainer.step, **trainer.final_scores(history)}))


def register(sub) -> None:
    train = sub.add_parser("train", help="train (or resume) a model on a corpus")
    train.add_argument(
        "config",
        nargs="+",
        help="a YAML path or shipped name, or a run directory to resume "
        "(its config.yaml; raise train.steps=N to extend a finished run), then key.sub=value overrides",
    )
    train.add_argument("--run-dir", help="where checkpoints and metrics go (default runs/<model name>)")
    train.set_defaults(run=run)

"""Checkpoints with orbax: the train state (params, optimizer state, rng) as arrays, and a JSON record
(step, data position, resolved config). Orbax writes each step to a temporary directory and renames it
when complete, so a crash never leaves a half-written step that looks valid; the last N are kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or made for another model; nothing was changed."""


def _diff(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = sorted(set(saved) | set(current))
        return [d for k in keys for d in _diff(saved.get(k), current.get(k), f"{path}.{k}" if path else k)]
    return [] if saved == current else [f"{path}: checkpoint {saved!r} vs now {current!r}"]


class Checkpointer:
    """Save and restore train states under one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3, *, create: bool = True):
        """`create=False` reads an existing directory and never writes (a missing one is an error)."""
        self.directory = Path(directory).resolve()
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"no checkpoint in {self.directory}")
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, record: dict) -> None:
        """Write `state` (a pytree of arrays) and `record` (JSON) as step `step`, waiting until done."""
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)),
            force=True,
        )
        self.manager.wait_until_finished()

    def read_record(self, step: int | None = None) -> tuple[int, dict]:
        """The JSON record of `step` (default: the latest) without loading any arrays."""
        step = self._step(step)
        path = self.directory / str(step) / "record" / "metadata"
        try:
            return step, json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has no readable record ({type(e).__name__}: {e}); "
                "it may be partial or corrupt. It was left as is: move it away to use an earlier step."
            ) from None

    def restore(
        self,
        abstract_state: Any,
        step: int | None = None,
        *,
        expect_config: dict | None = None,
        may_differ: tuple[str, ...] = (),
    ):
        """Load step `step` (default: the latest) into the structure of `abstract_state`.

        With `expect_config`, the saved config's `model`, `data` and `train` sections must equal it, so
        weights are never loaded into a model of another shape, nor resumed on another corpus or with
        another recipe (which would give results that neither recipe produces). Only `mesh` and the
        dotted fields named in `may_differ` (e.g. `train.steps`, to extend a run) may change.
        """
        step, record = self.read_record(step)
        if expect_config is not None:
            # Through JSON, as the record was written, so tuples compare equal to the lists they became.
            wanted = json.loads(json.dumps({k: expect_config[k] for k in ("model", "data", "train")}))
            saved = {k: record.get("config", {}).get(k) for k in wanted}
            diff = [d for d in _diff(saved, wanted) if d.partition(":")[0] not in may_differ]
            if diff:
                raise CheckpointError(
                    f"checkpoint {self.directory}/{step} was made with another config: "
                    + "; ".join(diff)
                    + ". Use a new run directory (or delete this one), or the original config."
                )
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except Exception as e:  # orbax raises many types for damaged files; say which step and why
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} cannot be read ({type(e).__name__}: {str(e)[:300]}); "
                "it may be partial or corrupt. It was left as is: move it away to use an earlier step."
            ) from None
        return restored.state, record

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} (have {steps})")
        return step


def abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of a pytree of arrays, for restoring into the same layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

"""Keeping a long-running process under Linux's limit on memory mappings.

XLA:CPU maps each compiled executable's code into memory (a small program takes about 15 mappings, a
30-layer model's decode loop many more), and jax keeps every program it compiled. A process that
compiles for hours (a RULER sweep of 20 policies over 11 tasks: about 28 minutes) reaches the kernel's
`vm.max_map_count` (65,530 by default) and LLVM's next allocation fails. `release_if_crowded` drops the
compiled programs when the process nears the limit; they are compiled again when next needed."""

from __future__ import annotations

from pathlib import Path

import jax

MAPS, LIMIT = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")


def mapped() -> int | None:
    """Memory mappings this process holds (None where /proc does not say)."""
    try:
        with MAPS.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def release_if_crowded(fraction: float = 0.6) -> bool:
    """Drop jax's compiled programs when the process holds more than `fraction` of the mappings the
    kernel allows; whether it did."""
    held = mapped()
    try:
        limit = int(LIMIT.read_text())
    except (OSError, ValueError):
        return False
    if held is None or held < fraction * limit:
        return False
    jax.clear_caches()
    return True

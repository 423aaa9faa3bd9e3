"""Allocators: how a stage spreads its token budget over layers and heads, chosen by `allocator=` and
registered here by name, each with its own options (`Options`, written `key=value` in the stage).

- `uniform`: every layer and head keeps the stage's budget.
- `pyramid` (PyramidKV: Cai et al. 2024, arXiv 2406.02069, sec. 3.3): lower layers keep more, upper
  layers less, the same total (`beta`: the top layer keeps about budget / beta).
- `adakv` (AdaKV: Feng et al. 2024, arXiv 2407.11550, alg. 1): the heads of a layer share K x budget
  entries, chosen by one top-k over all of them after each head's best `floor` x budget; the cache is
  a pool (`kvjax.cache.PooledKVCache`, `kvjax.compress.reducers.top_slots`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.config import ConfigError
from kvjax.options import Options


class Allocator:
    """An allocator: its `Options`, whether its caches are pools of every head's entries (`pooled`),
    whether it runs on an MLA latent (`mla`: one latent serves every head) and, per layer, what it keeps."""

    name: str
    Options: type[Options] = Options
    pooled = False
    mla = True
    same_everywhere = True  # every layer and head keeps the stage's budget (what the paged engine takes)

    def layer_counts(self, stage, length: int, n_layers: int) -> np.ndarray | None:
        """Tokens each of `n_layers` (> 1) layers keeps of a row of `length` tokens; None: the stage's
        budget in every layer."""
        return None

    def floors(self, stage, counts: np.ndarray) -> np.ndarray:
        """Entries each head of a pool keeps whatever the others score, per cache and row."""
        return np.zeros_like(counts)


class Uniform(Allocator):
    name = "uniform"


class Pyramid(Allocator):
    name = "pyramid"
    same_everywhere = False

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        beta: float = 20.0  # the top layer keeps budget / beta

        def check(self, where: str) -> None:
            if self.beta < 1:
                raise ConfigError(f"{where}: beta={self.beta} must be >= 1")

    def layer_counts(self, stage, length: int, n_layers: int) -> np.ndarray:
        """PyramidKV's layer budgets `[n_layers]`, as kvpress's `PyramidKVPress.get_layer_budget` computes
        them from the official code's rule: with k the mean budget (`length * (1 - ratio)`, or the size)
        and w the stage's fixed window, the budget falls linearly from max = 2k - k/beta at layer 0 to
        min = k/beta; when max exceeds length - w it is capped there and min = 2k - max, so the layers
        still sum to L x k. Each budget is rounded (`round`, as kvpress; the official code floors, which
        can overshoot the total); when the schedule would not hold (min below w, or max above the
        length) every layer keeps round(k), as kvpress falls back to SnapKV."""
        k = length * (1 - stage.ratio) if stage.ratio is not None else float(stage.size)
        w = stage.fixed_protected
        low = k / stage.allocator_options.beta
        high = 2 * k - low
        if high >= length - w:
            high = length - w
            low = 2 * k - high
        if not length >= high >= low >= w:
            return np.full(n_layers, round(k), np.int64)
        step = (high - low) / (n_layers - 1)
        # rounded at 1e-9 first, so float noise cannot tip a .5 (200 x 0.15 = 30.000000000000004) and break the sum
        return np.array([round(round(high - layer * step, 9)) for layer in range(n_layers)], np.int64)


class AdaKV(Allocator):
    name = "adakv"
    pooled = True
    mla = False  # no heads to share among
    same_everywhere = False

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        floor: float = 0.2  # each head keeps at least floor x its uniform share

        def check(self, where: str) -> None:
            if not 0 <= self.floor <= 1:
                raise ConfigError(f"{where}: floor={self.floor} must be in [0, 1]")

    def floors(self, stage, counts: np.ndarray) -> np.ndarray:
        return np.floor(stage.allocator_options.floor * counts + 1e-9).astype(np.int64)


ALLOCATORS = {a.name: a for a in (Uniform(), Pyramid(), AdaKV())}

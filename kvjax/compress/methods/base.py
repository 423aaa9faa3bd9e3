"""What a token-level method is, and the registry that looks methods up by name.

A method is a small class holding its defaults and hooks, registered with `@register`. A scoring method
(kind "scorer") has two: `observe` reduces the attention probabilities `[B,K,W,G,S]` of some queries (the
model computes them while it runs, `Decoder.observe`) to a per-slot statistic, and `score` turns that
statistic (or the cache alone) into a score per slot `[B,Kh,S]` (higher is kept; Kh = K when heads score
on their own, 1 when one score serves every head). A method that needs something from the model before
any prompt (Palu's calibrated bases, LoRC's weight bases, DuoAttention's streaming heads) computes it in
`prepare`, once per `Generator`. A method's own options are a small frozen dataclass (`Options`) that a
policy stage carries as `stage.options`; the budget and what every method shares (sinks, window,
allocator, reducer, every=) are the stage's own fields. `Generator`, the engine and the evaluations ask
the method, not its name.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.options import Options

METHODS: dict[str, Method] = {}


class Target(NamedTuple):
    """What one compressible cache becomes in a stage: `keep_cap` slots kept (of `capacity` with the
    headroom for decoding), the layer's RoPE base, what the method prepared for this cache (its entry
    of `bases` or `streaming`, None when it prepared nothing), `window`: the sliding window when
    the cache is a ring (`local=true`), else None, and `evicts`: the most slots a head evicts (a decode-time
    re-selection's: the `every` tokens since the last one), None when any number may go (a prompt's)."""

    keep_cap: int
    capacity: int
    rope_theta: float
    bases: tuple | None = None
    streaming: tuple | None = None
    window: int | None = None
    evicts: int | None = None

    @classmethod
    def of(cls, j: int, keep_caps, capacities, rope_theta, bases, streaming, window=None, evicts=None) -> Target:
        """Cache j's target from a stage plan's per-cache tuples (`bases` may be empty: sizes only)."""
        return cls(
            keep_caps[j],
            capacities[j],
            rope_theta,
            bases[j] if bases else None,
            streaming[j] if streaming else None,
            window,
            evicts,
        )

    def source(self, slots: int) -> int:
        """The slots a method that keeps every token in a plain cache (Quest) stores, of a cache of
        `slots`: all of them for a growing cache; for a ring, the W - 1 tokens its window still shows
        the next query, plus the headroom for decoding."""
        return slots if self.window is None else min(self.window - 1, slots) + self.capacity - self.keep_cap

    @staticmethod
    def capped(slots: int, most: int) -> int:
        """The slots of a ring a method re-encodes into a ring of its own (Quest's pages, ThinK's tail): what it
        would grow to, `slots`, at most `most`, all that a later query can still see. (A test lifts the cap to
        compare the ring with the same cache left to grow.)"""
        return min(slots, most)


@dataclasses.dataclass(frozen=True)
class Observed(Options):
    """The options of a method that scores by the attention of the last prompt queries."""

    obs_window: int = 32  # the last prompt queries that vote (Scissorhands: its history window)

    def check(self, where):
        self.at_least_one(where, "obs_window")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make the method available to policies as `cls.name`."""
    if cls.name in METHODS:
        raise ValueError(f"a token-level method named {cls.name!r} is registered already")
    METHODS[cls.name] = cls()
    return cls


class Method:
    """Defaults of a scoring method and its hooks; subclasses override what differs."""

    name: ClassVar[str]
    kind: ClassVar[str] = "scorer"  # what the policy grammar calls it: a scorer, or "channels" (ThinK)
    sinks: ClassVar[int] = 0  # first positions always kept, unless the stage says `sinks=`
    per_head: ClassVar[bool] = False  # each KV head keeps its own tokens (positions stored per head)
    accumulates: ClassVar[bool] = False  # a decode-time statistic adds up over steps (H2O's attention sums)
    # its statistic is a sum over the observed queries, so blocks of them can be observed one at a time
    # and added (no [T, S] probabilities when it observes a whole prompt)
    additive: ClassVar[bool] = False
    counts_visible: ClassVar[bool] = False  # `observe` needs which keys each query could see
    pageable: ClassVar[bool] = False  # the serving engine holds what it keeps in pages (kvjax.engine)
    head_keys: ClassVar[bool] = False  # it needs each KV head's own keys (not MLA's one shared latent)
    poolable: ClassVar[bool] = True  # it runs on an AdaKV pool (one entry axis for every head)
    prepares: ClassVar[tuple[str, ...]] = ()  # what `prepare` gives `plan_stages` (keyword names)
    needs_calibration: ClassVar[bool] = False  # `prepare` needs calibration tokens
    budgets_at_prefill: ClassVar[bool] = False  # its layer budgets come from the prefill (`layer_budgets`)
    extra_bytes_per_sequence: ClassVar[int] = 0  # state a method adds to each compressed cache (D2O's threshold)
    recent: ClassVar[int] = 0  # a fixed recent window the method keeps unless `window=` (DuoAttention, ThinK)
    alone: ClassVar[str] = ""  # why it cannot be chained with other stages ("" when it can)
    rings: ClassVar[str] = ""  # why it cannot compress sliding-window rings (`local=true`; "" when it can)
    Options: ClassVar[type[Options]] = Options  # its own options (`stage.options` holds an instance)

    def validate(self, stage, where: str) -> None:
        """Errors for a stage this method cannot run whatever the model (a budget of the wrong kind, a
        shared option that does not apply), raised when the policy is parsed; its options' own values
        are checked by `stage.options.check`."""

    def check(self, stage, cfg) -> None:
        """Errors for a model config this stage cannot run on, raised before any compute."""

    def prepare(self, stage, model, caches: tuple, calibration=None, shapes_only: bool = False) -> dict:
        """What the stage needs from `model` before any prompt, as keyword arguments of `plan_stages`
        (`prepares` names them), for the policy's compressible `caches` (`kvjax.plan.compressible`: under
        `local=true`, which the first stage says, the rings too). `shapes_only`: only what sizes the caches
        is wanted (memory accounting), so a method whose sizes do not depend on the model may skip the work."""
        return {}

    def window(self, stage, keep: int) -> int:
        """Recent tokens always kept when `keep` tokens are kept (the stage's `window=` overrides it)."""
        return 0

    def fixed_window(self, stage) -> int:
        """The part of `window` that does not scale with the budget (the least a layer may keep)."""
        return 0

    def observed_queries(self, stage, length: int) -> int:
        """How many of the last prompt queries the method observes (0: none; `length`: all)."""
        return 0

    def observe(
        self, stage, probs: jax.Array, obs_pos: jax.Array, pooled: bool, visible=None, queries=None
    ) -> jax.Array | None:
        """The statistic of probabilities `[B,K,W,G,S]` of queries at positions obs_pos `[B,W]` (-1: none):
        per slot `[B,Kh,S]`, or None for a method that does not read attention. `pooled`: the cache is an
        AdaKV pool (one entry axis); `visible`: which keys each query could see; `queries` `[B,W,N,H]`:
        the observed queries themselves (None for MLA)."""
        return None

    def encode(self, stage, cache, stat, target: Target):
        """For a method that re-encodes a cache instead of choosing its slots (a low-rank latent, pruned
        key channels, streaming heads): the new cache for `target`; None (the default) for a scorer, whose
        scores choose the kept slots."""
        return None

    def cache_bytes(self, stage, target: Target, mem, K: int, item: int, positions: int, source: int) -> int | None:
        """Exact bytes of one sequence's cache after this (last) stage, for a method whose `encode` makes
        its own cache: `mem` the layer's `LayerMemory`, K its KV heads, `item` the dtype's bytes,
        `positions` the positions stored per slot, `source` the slots of the cache it was given. None
        (the default): the kept slots in the cache's own layout, which `compressed_cache_bytes` counts."""
        return None

    def keep_cap(self, stage, cap: int) -> int:
        """The slots a cache allots for `cap` kept tokens (Quest reads whole pages)."""
        return cap

    def merge_layers(self, stage, caches: list, slots: tuple[int, ...], keep_caps, capacities):
        """For a method that compresses layers together (MiniCache's pairs): every cache after it, as a
        list; None (the default): each compressible cache is compressed on its own."""
        return None

    def layers_bytes(self, stage, cfg, keep_caps, capacities) -> dict[int, int] | None:
        """For `merge_layers`: exact bytes per sequence of each layer it changed, by layer index (the
        others keep every token); None when the method compresses each cache on its own."""
        return None

    def merge(self, stage, cache, idx: jax.Array, valid: jax.Array, stat, target: Target):
        """Fold the evicted slots into the kept ones (`idx`, `valid`: the kept slots; `target.evicts` bounds
        how many a head evicts) before they are gathered; None (the default): the stage's `reducer=` decides."""
        return None

    def layer_density(self, stat: jax.Array, pos: jax.Array) -> jax.Array:
        """For `budgets_at_prefill`: a compressible layer's statistic `[B]` from its observed statistic
        and its cache's slot positions, computed inside the jitted prefill."""
        raise NotImplementedError(f"method {self.name!r} plans no layer budgets")

    def layer_budgets(self, stage, density, lengths, never: int):
        """For `budgets_at_prefill`: tokens kept per compressible cache and row `[n, B]` (numpy) from the
        layers' densities `[n, B]`; `never`: a count no layer reaches (the cache's capacity)."""
        raise NotImplementedError(f"method {self.name!r} plans no layer budgets")

    def score(self, stage, cache, stat: jax.Array | None, last_pos: jax.Array) -> jax.Array:
        """Scores `[B,Kh,S]` (higher is kept); `stat` is `observe`'s statistic, never None for a method
        that observes queries (the caller checks)."""
        raise NotImplementedError(f"method {self.name!r} scores no slot")


def voters(obs_pos: jax.Array, window: int | None) -> jax.Array:
    """The observed queries `[B,W]` that vote: every real one, or the last `window` of each row."""
    if window is None:
        return obs_pos >= 0
    last = jnp.max(obs_pos, axis=1)[:, None]
    return (obs_pos >= 0) & (obs_pos > last - window)


def attention_received(probs: jax.Array, voter: jax.Array) -> jax.Array:
    """Attention each key received from the voting queries, summed over them and averaged over the
    query heads of its KV head: `[B,K,S]`."""
    return jnp.where(voter[:, None, :, None, None], probs, 0.0).sum(axis=2).mean(axis=2)


def slot_positions(cache) -> jax.Array:
    """Positions `[B,Kh,S]` of a cache's slots (shared by the heads, Kh = 1, or per head)."""
    return cache.pos if cache.pos.ndim == 3 else cache.pos[:, None, :]

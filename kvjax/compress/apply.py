"""Running a policy over a model's caches: the host-side budget plan (checked before any compute) and
the pure, jit-able compression of every compressible cache.

Compressible caches are those that grow with the sequence: attention producers without a window
(the GQA family, CLA / MLKV producers, YOCO's global cache) and MLA's latent cache. Sliding-window
rings are left whole (already bounded) unless the policy says `local` (`kvjax.compress.policy`); gated
retention, Mamba and RWKV states always are. MLA has one
latent per token shared by all heads, so head-wise methods (AdaKV) do not apply, key norm has no keys
to measure and CaM has no separate values to merge: those raise a clear error.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import (
    KVCache,
    LatentCache,
    PooledKVCache,
    RingKVCache,
    WindowKVCache,
    WindowPooledKVCache,
    layer_slots,
)
from kvjax.compress import reducers, scorers
from kvjax.compress.methods.base import Target
from kvjax.compress.policy import Policy, Stage, stage_counts
from kvjax.config import ConfigError, ModelConfig
from kvjax.kinds import INT32
from kvjax.memory import layer_memory
from kvjax.ops import grouped_mask
from kvjax.plan import compressible, kv_heads, ring_window, rope_base
from kvjax.quant import QuantKVCache, QuantSpec
from kvjax.quant.cache import WindowQuantKVCache
from kvjax.quant.lowrank import LowRankKVCache, WindowLowRankKVCache
from kvjax.quant.packing import packed_width
from kvjax.quant.parts import LowRankError, Outliers, Sinks


def check_policy(policy: Policy, cfg: ModelConfig) -> None:
    """Errors for a policy this model cannot run, before any compute."""
    slots = compressible(cfg, policy.local)
    if not slots:
        raise ConfigError(
            f"model {cfg.name!r} has no cache that grows with the sequence (layers: {sorted(set(cfg.mixers))}); "
            "there is nothing for a token-level policy to compress (local=true compresses sliding-window rings)"
        )
    if policy.local:
        if slots == compressible(cfg):
            raise ConfigError(f"policy: local=true compresses sliding-window rings, and {cfg.name!r} has none")
        window = min(w for w in map(functools.partial(ring_window, cfg), slots) if w)
        for stage in policy.stages:
            if stage.hooks and stage.hooks.rings:
                raise ConfigError(f"policy stage {stage.method!r}: local=true does not apply: {stage.hooks.rings}")
            if stage.quantizes and stage.quant_spec.blocked and stage.quant_spec.residual > window:
                raise ConfigError(
                    f"policy stage {stage.method!r}: residual={stage.quant_spec.residual} must be at most the "
                    f"sliding window ({window} tokens) of the rings local=true compresses: a ring holds the window"
                )
    mla = "mla" in cfg.mixers
    for i, stage in enumerate(policy.stages):
        where = f"policy stage {stage.method!r}"
        method = stage.hooks
        if stage.pooled and i != len(policy.stages) - 1:
            raise ConfigError(f"{where}: allocator='adakv' must be the last stage of a chain")
        if stage.quantizes and any(s.pooled for s in policy.stages):
            raise ConfigError(f"{where}: quantizing an AdaKV pool is not supported; use a uniform allocator")
        if mla and method is not None and method.head_keys:
            raise ConfigError(
                f"{where}: {cfg.name!r} has MLA layers, whose one latent serves every head: {stage.method} needs "
                "each KV head's own keys"
            )
        if mla and stage.encodes:
            raise ConfigError(f"{where}: quantizing or factoring MLA's latent cache is not implemented")
        if method is not None and not method.poolable and any(s.pooled for s in policy.stages):
            raise ConfigError(f"{where}: {stage.method} cannot run on an AdaKV pool; use a uniform allocator")
        for part in (stage.allocation, stage.reduction):
            if mla and not part.mla:
                raise ConfigError(
                    f"{where}: {cfg.name!r} has MLA layers, whose cache is one latent shared by all heads: "
                    f"{part.name} (it needs separate heads and values) does not apply"
                )
        if stage.quantizes and stage.quant_spec.scheme.pre_rope_keys and cfg.attention.rope_scaling is not None:
            raise ConfigError(
                f"{where}: {stage.method} keeps keys before RoPE and re-rotates them with plain RoPE; "
                f"{cfg.name!r} scales its RoPE frequencies (model.attention.rope_scaling)"
            )
        if method is not None:
            method.check(stage, cfg)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's budgets over the compressible caches: tokens kept per head and row `counts`
    `[n, B]`, always-kept recent tokens `windows` `[n, B]`, AdaKV per-head floors `floors` `[n, B]`;
    static slot counts `keep_caps` (largest budget, K x it for a pool) and `capacities` (plus headroom),
    and the KV heads a pool spreads each budget over (`heads`, 1 when not pooled)."""

    stage: Stage
    counts: np.ndarray
    windows: np.ndarray
    floors: np.ndarray
    keep_caps: tuple[int, ...]
    capacities: tuple[int, ...]
    heads: tuple[int, ...]
    quant: QuantSpec | None = None  # a quantizing stage's spec (each cache's RoPE base added as it runs)
    rope_thetas: tuple = ()  # per compressible cache, its keys' RoPE base (pre-RoPE encoders undo it)
    bases: tuple | None = None  # Palu: (k_basis, v_basis) per compressible cache, from calibration
    streaming: tuple | None = None  # DuoAttention: the streaming KV heads of each compressible cache
    rings: tuple = ()  # per compressible cache, its sliding window when it is a ring (local=true), else None

    @property
    def static(self):
        """The hashable part, a static argument of the jitted compression."""
        return (
            self.stage,
            self.keep_caps,
            self.capacities,
            self.heads,
            self.quant,
            self.rope_thetas,
            self.streaming,
            self.rings,
        )

    @property
    def arrays(self):
        """The per-row budgets as device arrays (rows may differ without recompiling), and Palu's bases."""
        budgets = tuple(jnp.asarray(a, jnp.int32) for a in (self.counts, self.windows, self.floors))
        return (*budgets, self.bases)


def prepare_policy(policy: Policy, model, calibration=None, shapes_only: bool = False) -> dict:
    """What the policy's stages need from `model` before any prompt (each method's `prepare`: Palu's
    calibrated bases, LoRC's weight bases, DuoAttention's streaming heads), as keyword arguments of
    `plan_stages`. `shapes_only`: for memory accounting, only what sizes the caches."""
    prepared, caches = {}, compressible(model.config, policy.local)
    for stage in policy.stages:
        if stage.hooks:
            prepared.update(stage.hooks.prepare(stage, model, caches, calibration, shapes_only))
    return prepared


def needs_calibration(policies) -> bool:
    """Whether any stage of `policies` needs calibration tokens to prepare (Palu)."""
    return any(s.hooks and s.hooks.needs_calibration for p in policies for s in p.stages)


def plan_stages(
    cfg: ModelConfig,
    stages: tuple[Stage, ...],
    lengths,
    headroom: int,
    bases: tuple | None = None,
    streaming: tuple | None = None,
    layer_counts: np.ndarray | None = None,
) -> tuple[StagePlan, ...]:
    """Budgets of each stage for rows of `lengths` tokens; the last stage's caches get `headroom` free
    slots per head for the tokens that follow. `bases`: Palu's calibrated bases (`calibrate`);
    `streaming`: DuoAttention's streaming heads per compressible cache (`kvjax.duo.streaming_heads`);
    `layer_counts`: D2O's tokens kept per cache and row `[n, B]` (`d2o.layer_counts`, from the prefill).
    Raises ConfigError for impossible budgets. A ring's (local=true) budget is taken of the tokens still
    in its window, min(L, W - 1); a size above them keeps them all (Quest's size, tokens read, is capped
    at the window W)."""
    slots = compressible(cfg, stages[0].local)
    rings = tuple(ring_window(cfg, s) for s in slots) if stages[0].local else (None,) * len(slots)
    current = np.stack([np.minimum(np.asarray(lengths, np.int64), (w or 1 << 62) - 1) for w in rings]).reshape(
        len(slots), len(lengths)
    )
    plans = []
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        counts = np.stack([_counts(stage, current, j, rings[j]) for j in range(len(slots))])
        if stage.hooks and stage.hooks.budgets_at_prefill:
            if layer_counts is None:
                raise ConfigError(f"policy stage {stage.method!r} needs its layer budgets from the prefill's attention")
            counts = np.asarray(layer_counts, np.int64)
        windows = np.vectorize(stage.n_window)(counts)
        floors = stage.allocation.floors(stage, counts)
        heads = [kv_heads(cfg, s) if stage.pooled else 1 for s in slots]
        keep_caps = tuple(int(counts[j].max()) * heads[j] for j in range(len(slots)))
        if stage.hooks:
            keep_caps = tuple(stage.hooks.keep_cap(stage, cap) for cap in keep_caps)
        capacities = tuple(keep_caps[j] + (headroom * heads[j] if last else 0) for j in range(len(slots)))
        ringed = tuple(bool(w) and last and wraps(stage) for w in rings)
        if last and wraps(stage):  # a compressed ring holds the window at most (a `Ring`): W slots, K W entries
            capacities = tuple(min(c, w * h) if w else c for c, w, h in zip(capacities, rings, heads))
        quant = stage.quant_spec if stage.quantizes else None
        if quant is not None:  # key groups (a ring's: GEAR's error blocks too) tile the quantized cache
            capacities = tuple(quant.slots(c, ring) for c, ring in zip(capacities, ringed))
        prepared = {"bases": bases, "streaming": streaming}
        needs = stage.hooks.prepares if stage.hooks else ()
        missing = [name for name in needs if prepared[name] is None]
        if missing:
            raise ConfigError(
                f"policy stage {stage.method!r} needs its {', '.join(missing)} from the model before any "
                "prompt (`prepare_policy`; Generator does it, given calibration=tokens where a method needs them)"
            )
        plans.append(
            StagePlan(
                stage,
                counts,
                windows,
                floors,
                keep_caps,
                capacities,
                tuple(heads),
                quant,
                tuple(rope_base(cfg, s) for s in slots),
                bases if "bases" in needs else None,
                streaming if "streaming" in needs else None,
                rings,
            )
        )
        current = counts
    return tuple(plans)


def _counts(stage: Stage, current: np.ndarray, j: int, ring: int | None) -> np.ndarray:
    """Tokens compressible cache j keeps per row, of `current` `[n, B]` tokens per cache. A size on a ring
    keeps at most its in-window tokens (all of them when it is above them); Quest's size, tokens read per
    step, is a cap at the window W instead."""
    if ring and stage.size is not None:
        if stage.hooks is not None and stage.hooks.kind == "selector":
            return np.full_like(current[j], min(stage.size, ring))
        if stage.size >= current[j].min():
            return np.minimum(stage.size, current[j])
    return stage_counts(stage, current[j], len(current))[j]


def observe_fn(stages: tuple[Stage, ...]):
    """The `reduce` passed to `Decoder.observe`: each stage's statistic of the observed attention."""

    def reduce(probs, obs_pos, view, queries=None):
        pooled = getattr(view, "head", None) is not None
        visible = None  # which keys each observed query saw (Scissorhands' average is over them)
        if scorers.needs_visibility(stages):
            visible = grouped_mask(obs_pos, view.pos, None, getattr(view, "head", None), probs.shape[1])
        return tuple(scorers.observe(stage, probs, obs_pos, pooled, visible, queries) for stage in stages)

    # blocks of the observed queries may be reduced one at a time and their statistics added
    reduce.additive = all(scorers.additive(stage) for stage in stages)
    return reduce


def wraps(stage: Stage) -> bool:
    """Whether a ring this (last) stage compresses becomes a ring again, capped at its window: token eviction
    into the cache's own layout (`WindowKVCache`, what the engine can page; an AdaKV pool,
    `WindowPooledKVCache`), a quantizer's codes and parts (`WindowQuantKVCache`) or a low-rank latent
    (`WindowLowRankKVCache`): the plan caps their capacity at the window. Quest and ThinK make rings of their
    own in `encode` (`Target.capped`), DuoAttention of its retrieval heads."""
    return stage.quantizes or (stage.hooks is not None and stage.hooks.kind in ("scorer", "low_rank"))


_RINGS = {
    KVCache: WindowKVCache,
    PooledKVCache: WindowPooledKVCache,
    QuantKVCache: WindowQuantKVCache,
    LowRankKVCache: WindowLowRankKVCache,
}


def compress_caches(caches, observed, statics, arrays, last_pos, slots: tuple[int, ...], evicts: int | None = None):
    """Apply stages (their `StagePlan.static` / `.arrays`) to the compressible caches `slots`, in order.

    observed: per cache, the tuple of per-stage statistics from `observe_fn` (None: not observed).
    `evicts`: the most slots a head evicts (`Target.evicts`: a decode-time re-selection's `every`).
    Returns (caches, per cache the last stage's statistic, following the kept slots)."""
    caches, last_stats = list(caches), [None] * len(caches)
    stage, keep_caps, capacities = statics[0][:3]
    merged = stage.hooks.merge_layers(stage, caches, slots, keep_caps, capacities) if stage.hooks else None
    if merged is not None:  # layers compressed together (MiniCache's pairs), not one cache at a time
        return tuple(merged), tuple(last_stats)
    rings = statics[0][7]
    for j, slot in enumerate(slots):
        cache = caches[slot]
        stats = list(observed[slot]) if observed[slot] is not None else [None] * len(statics)
        if rings[j]:  # a sliding-window layer (local=true): only the tokens a next query still sees
            cache, stats = _in_window(cache, stats, last_pos, rings[j])
        for static, (counts, windows, floors, bases) in zip(statics, arrays):
            stage, keep_caps, capacities, heads, quant, thetas, streaming, _ = static
            target = Target.of(j, keep_caps, capacities, thetas[j], bases, streaming, rings[j], evicts)
            cache, stats = reduce_cache(
                stage, cache, stats, counts[j], windows[j], floors[j], last_pos, target, heads[j], quant
            )
            stats = stats[1:] or stats  # the next stage's statistic comes first; the last one is kept
        if rings[j] and wraps(statics[-1][0]) and type(cache) in _RINGS:
            cache = _RINGS[type(cache)].of(cache)
        caches[slot], last_stats[slot] = cache, stats[0]
    return tuple(caches), tuple(last_stats)


def _in_window(cache, stats, last_pos, window: int):
    """A sliding-window layer's cache as a position-masked KVCache of the tokens that the query after
    `last_pos` still sees (positions > last_pos + 1 - window; the others marked empty), and its per-slot
    statistics with it. A ring (after the prefill) is laid out in position order, as a prompt's cache
    is (scorers that pool neighbouring slots, SnapKV's, must not pool across the ring's wrap), its
    statistics gathered from the prompt positions they were observed over; a cache already compressed
    keeps its layout."""
    live = cache.pos > (last_pos + 1 - window).reshape((-1,) + (1,) * (cache.pos.ndim - 1))
    pos = jnp.where(live, cache.pos, -1)
    if isinstance(cache, WindowKVCache):  # compressed before and wrapped since: back to position order
        return _position_ordered(cache.replace(pos=pos), stats)
    if not isinstance(cache, RingKVCache):
        return cache.replace(pos=pos), stats
    order = jnp.argsort(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max), axis=1)  # [B,W], empty last
    pos = jnp.take_along_axis(pos, order, axis=1)
    k, v = (jnp.take_along_axis(x, order[:, None, :, None], axis=2) for x in (cache.k, cache.v))
    linear = KVCache(k=k, v=v, pos=pos, length=(pos >= 0).sum(axis=1, dtype=jnp.int32))

    def at_slots(stat):  # [B,Kh,T] over the prompt's positions -> [B,Kh,W] over the new slots
        if not isinstance(stat, jax.Array):
            return stat
        idx = jnp.broadcast_to(jnp.clip(pos, 0, stat.shape[-1] - 1)[:, None], (*stat.shape[:2], pos.shape[1]))
        return jnp.where(pos[:, None] >= 0, jnp.take_along_axis(stat, idx, axis=2), 0)

    return linear, [at_slots(s) for s in stats]


def _position_ordered(cache: WindowKVCache, stats):
    """A compressed ring's slots (and the statistics that follow them) sorted by position, empty ones last,
    as a plain KVCache: what decode-time eviction (`every=`) compresses again."""
    axis = cache.pos.ndim - 1  # positions [B,S], or per head [B,K,S]
    order = jnp.argsort(jnp.where(cache.pos >= 0, cache.pos, jnp.iinfo(jnp.int32).max), axis=axis)
    per_slot = order[:, None] if axis == 1 else order  # [B,1|K,S]: the order of every head's slots
    k, v = (jnp.take_along_axis(x, per_slot[..., None], axis=2) for x in (cache.k, cache.v))
    pos = jnp.take_along_axis(cache.pos, order, axis=axis)
    follow = lambda stat: stat if not isinstance(stat, jax.Array) else jnp.take_along_axis(stat, per_slot, axis=2)  # noqa: E731
    held = (pos >= 0).sum(axis=-1, dtype=jnp.int32)
    length = held if axis == 1 else held.max(axis=1)
    return KVCache(k=k, v=v, pos=pos, length=length), [follow(st) for st in stats]


def reduce_cache(stage: Stage, cache, stats, count, window, floor, last_pos, target: Target, heads: int, quant=None):
    """One stage on one cache. stats[0] is this stage's statistic, the rest belong to later stages; all
    follow the kept slots. `target`: the slots kept and allotted, and what the method prepared for this
    cache; `heads`: the KV heads a pooled (AdaKV) cache spreads its budget over; `quant`: a quantizer's
    spec. Returns (new cache, the statistics gathered to its slots)."""
    keep_cap, capacity = target.keep_cap, target.capacity
    if stage.quantizes:
        return QuantKVCache.from_cache(cache, dataclasses.replace(quant, rope_theta=target.rope_theta), capacity), stats
    method = stage.hooks
    encoded = method.encode(stage, cache, stats[0], target)
    if encoded is not None:
        return encoded, stats
    if stage.pooled and isinstance(cache, KVCache):
        pooled = [reducers.to_pool(cache, s) for s in stats]
        cache, stats = pooled[0][0], [p[1] for p in pooled]
    pooled = not isinstance(cache, KVCache | LatentCache)
    stat = stats[0]
    scores = scorers.score(stage, cache, stat, last_pos)
    pos = cache.pos if cache.pos.ndim == 3 else cache.pos[:, None]
    Kh = max(scores.shape[1], pos.shape[1])
    shape = (pos.shape[0], Kh, pos.shape[-1])
    idx, valid = reducers.top_slots(
        jnp.broadcast_to(scores, shape),
        jnp.broadcast_to(pos, shape),
        count * heads if pooled else count,
        keep_cap,
        sinks=stage.n_sinks,
        window=window,
        last_pos=last_pos,
        floor=floor if pooled else None,
        head=cache.head[:, None] if pooled else None,
    )
    merged = method.merge(stage, cache, idx, valid, stat, target)  # a method's own (D2O), else the stage's reducer
    cache = stage.reduction.merge(cache, idx, valid, stat, stage.reducer_options) if merged is None else merged
    new = reducers.gather(cache, idx, valid, capacity, per_head=Kh > 1)
    return new, [reducers.gather_stat(s, idx, valid, capacity) for s in stats]


def compressed_cache_bytes(cfg: ModelConfig, plans: tuple[StagePlan, ...], batch: int, capacity: int) -> int:
    """Exact bytes of a model's caches after `plans` ran on caches of `capacity` slots: compressed caches
    at their planned capacity (payload, positions shared or per head, pool head ids, length counter),
    every other cache as `kvjax.memory` counts it."""
    per_head = any(p.stage.per_head for p in plans)
    last = plans[-1]
    total = 0
    slots = compressible(cfg, plans[0].stage.local)
    method = last.stage.hooks
    merged = method.layers_bytes(last.stage, cfg, last.keep_caps, last.capacities) if method is not None else None
    for slot, mem in enumerate(layer_memory(cfg)):
        if merged is not None or slot not in slots:  # layers merged together, or not compressed
            total += merged[slot] if merged and slot in merged else mem.bytes(capacity)
            continue
        j = slots.index(slot)
        cap, K, item = last.capacities[j], kv_heads(cfg, slot), jnp.dtype(cfg.dtype).itemsize
        source = layer_slots(mem.max_slots, capacity)
        mem = dataclasses.replace(mem, max_slots=None)  # a compressed ring is a plain cache
        positions = K if per_head and K > 1 else 1
        if last.stage.quantizes:
            head_dim = mem.kv_bytes_per_slot // (2 * K * item)
            total += quant_cache_bytes(last.quant, cap, K, head_dim, cfg.dtype, positions=positions)
            continue
        if method is not None:
            target = Target.of(
                j, last.keep_caps, last.capacities, last.rope_thetas[j], last.bases, last.streaming, last.rings[j]
            )
            encoded = method.cache_bytes(last.stage, target, mem, K, item, positions, source)
            if encoded is not None:
                total += encoded
                continue
        if last.stage.pooled:  # entry: one head's K and V, its position and its head id
            slot_bytes = mem.kv_bytes_per_slot // K + 2 * INT32
        else:
            slot_bytes = mem.kv_bytes_per_slot + INT32 * positions
        extra = method.extra_bytes_per_sequence if method is not None else 0
        total += cap * slot_bytes + mem.bytes_per_sequence + extra
    return batch * total


def quant_cache_bytes(spec, capacity: int, K: int, H: int, dtype, positions: int = 1) -> int:
    """Exact bytes of one sequence's `QuantKVCache` of `capacity` slots, part by part: packed codes,
    scales and zero points, the blocked schemes' residual, exact outliers (value + uint8 channel), exact
    sinks, the low-rank error's factors, positions (`positions` per slot) and two int32 counters."""
    item = jnp.dtype(dtype).itemsize
    codes = 2 * K * packed_width(H, spec.bits)
    if not spec.blocked:  # one K scale and one V scale (and zero points with asym) per token and head
        total, fixed = capacity * (codes + 2 * K * item * (2 if spec.asym else 1)), 0
    else:  # keys: scale + zero per channel per group of tokens; values: per token per channel group
        groups = H // spec.value_group(H)
        total = capacity * (codes + 2 * K * groups * item) + capacity // spec.group * 2 * K * H * item
        fixed = 2 * K * spec.residual * H * item
    if spec.scheme.outliers is not None:
        total += Outliers.nbytes(capacity, K, spec.n_outliers(H), item)
    if spec.scheme.exact_sinks:
        fixed += Sinks.nbytes(K, spec.sinks, H, item)
    if spec.rank:
        total += LowRankError.nbytes(capacity, K, H, spec.rank, spec.residual, item)
    return total + fixed + capacity * INT32 * positions + 2 * INT32

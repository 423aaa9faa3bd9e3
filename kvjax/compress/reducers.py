"""Reducers: keep the best-scored slots of a cache (always keeping the sinks and the recent window),
optionally merging the evicted slots into the kept ones, and write them to a smaller cache.

Shapes stay static: a compressed cache has a fixed capacity (the largest row's budget plus headroom
for new tokens); a row that keeps fewer tokens leaves empty slots (position -1). Kept slots are
compacted to the front in their original order, so the next token goes to slot `length`, at its true
position.

What happens to the evicted slots is the stage's `reducer=` (registered in `REDUCERS`, each with its
own options): `select` drops them, `cam` and `kvmerger` merge them.

- `select`: top-k by score (sinks and window scored +inf). Head-wise scores give each head its own
  tokens: positions are then stored per head, `[B,K,S]`.
- AdaKV (Feng et al. 2024, arXiv 2407.11550, alg. 1): one top-k over all heads of a layer (K x budget
  entries), after each head's best `floor x budget` entries are guaranteed; the result is a
  `PooledKVCache`, so a head that keeps more really stores more and the total is exactly K x budget.
- CaM-style merge (Zhang et al. 2024, ICML, "CaM: Cache Merging"): each evicted value is merged into
  the next kept value in sequence order, weighted by min(1, a_e / a_t), the ratio of its attention
  score to the target's (CaM's merge probability, used as a deterministic weight); kept keys are
  untouched. We take the weighted mean (v_t + sum p_e v_e) / (1 + sum p_e) so that many merges into
  one slot cannot blow up its scale (CaM adds p_e v_e / m into m following slots).
- KVMerger-style merge (Wang et al. 2024, arXiv 2407.08454): each evicted key joins the kept key it
  is most similar to (cosine), and both keys and values become the Gaussian-kernel weighted mean
  with weights exp(-||u_e - u_t||^2 / (2 sigma^2)) over unit keys u (1 for the kept pivot).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache, LatentCache, PooledKVCache
from kvjax.config import ConfigError
from kvjax.options import Options

_FORCED = 1e30  # above any score, below the +inf that marks sinks and window


def protected(pos: jax.Array, sinks: int, window: jax.Array, last_pos: jax.Array) -> jax.Array:
    """Slots that must survive: the first `sinks` positions and the `window[b]` most recent ones."""
    b = (slice(None),) + (None,) * (pos.ndim - 1)
    recent = pos > (last_pos - window)[b]
    return (pos >= 0) & ((pos < sinks) | recent)


def top_slots(scores, pos, count, keep_cap: int, *, sinks, window, last_pos, floor=None, head=None):
    """Indices `[B,Kh,C]` of the slots to keep, compacted in slot order, and their validity; C is
    keep_cap, or the S slots there are when a cap (`every=`) is above them.

    scores, pos `[B,Kh,S]`; row b keeps count[b] slots per head (for a pool: in all), or every filled
    slot when it has fewer (a budget is a cap). With `floor` (AdaKV) and the pool's `head` ids
    `[B,1,S]`, each head's best floor[b] entries are kept first.
    """
    filled = pos >= 0
    # Empty slots leave the ranking first: a scorer may rate them above real tokens (key norm scores a
    # zero key 0, above every -||k||), and a head's guaranteed floor must go to its real tokens.
    s = jnp.where(protected(pos, sinks, window, last_pos), jnp.inf, scores.astype(jnp.float32))
    s = jnp.where(filled, s, -jnp.inf)
    if floor is not None:
        guaranteed = (_within_head_rank(s, head) < floor[:, None, None]) & filled
        s = jnp.where(guaranteed, jnp.maximum(s, _FORCED), s)
    C = min(keep_cap, s.shape[-1])
    _, idx = jax.lax.top_k(s, C)
    chosen = jnp.take_along_axis(filled, idx, axis=-1)  # empty slots rank last
    valid = (jnp.arange(C)[None, None, :] < count[:, None, None]) & chosen
    S = s.shape[-1]
    key = jnp.sort(jnp.where(valid, idx, S + idx), axis=-1)
    return jnp.where(key < S, key, key - S), key < S


def _within_head_rank(s, head):
    """Rank (0 = best) of each pool entry among the entries of its own head."""
    order = jnp.lexsort((-s, head), axis=-1)  # by head, then best first
    sorted_head = jnp.take_along_axis(head, order, axis=-1)
    first = jax.vmap(jax.vmap(lambda h: jnp.searchsorted(h, h, side="left")))(sorted_head)
    rank_sorted = jnp.arange(s.shape[-1])[None, None, :] - first
    return jnp.take_along_axis(rank_sorted, jnp.argsort(order, axis=-1), axis=-1)


def _take(x, idx, valid, capacity: int, head_major: bool, fill=0):
    """Gather slots idx `[B,Kh,C]` of x (head-major `[B,K,S,...]` or token-major `[B,S,...]`), blank the
    invalid ones with `fill` and pad to `capacity` slots."""
    if head_major:
        idx_b = jnp.broadcast_to(idx, (*x.shape[:2], idx.shape[-1]))
        valid_b = jnp.broadcast_to(valid, idx_b.shape)
        extra = (None,) * (x.ndim - 3)
        out = jnp.take_along_axis(x, idx_b[(...,) + extra], axis=2)
        out = jnp.where(valid_b[(...,) + extra], out, fill)
        axis = 2
    else:
        extra = (None,) * (x.ndim - 2)
        out = jnp.take_along_axis(x, idx[:, 0][(...,) + extra], axis=1)
        out = jnp.where(valid[:, 0][(...,) + extra], out, fill)
        axis = 1
    pad = [(0, 0)] * out.ndim
    pad[axis] = (0, capacity - out.shape[axis])
    return jnp.pad(out, pad, constant_values=fill)


def gather(cache, idx, valid, capacity: int, per_head: bool):
    """The cache holding only slots idx `[B,Kh,C]` (valid ones), compacted, with `capacity` slots."""
    length = valid[:, 0].sum(axis=-1).astype(jnp.int32)
    if isinstance(cache, LatentCache):
        return cache.replace(
            c=_take(cache.c, idx, valid, capacity, False),
            k_rope=_take(cache.k_rope, idx, valid, capacity, False),
            pos=_take(cache.pos, idx, valid, capacity, False, -1),
            length=length,
        )
    if isinstance(cache, PooledKVCache):
        return cache.replace(
            k=_take(cache.k, idx, valid, capacity, False),
            v=_take(cache.v, idx, valid, capacity, False),
            pos=_take(cache.pos, idx, valid, capacity, False, -1),
            head=_take(cache.head, idx, valid, capacity, False),
            length=length,
        )
    pos = cache.pos
    if per_head and pos.ndim == 2:
        pos = jnp.broadcast_to(pos[:, None], (pos.shape[0], cache.k.shape[1], pos.shape[1]))
    return cache.replace(
        k=_take(cache.k, idx, valid, capacity, True),
        v=_take(cache.v, idx, valid, capacity, True),
        pos=_take(pos, idx, valid, capacity, pos.ndim == 3, -1),
        length=length,
    )


def gather_stat(stat, idx, valid, capacity: int):
    """A per-slot statistic `[B,Kh,S]` following its slots into the compressed cache (0 when empty)."""
    if stat is None or not isinstance(stat, jax.Array):  # None, or per channel (ThinK), not per slot
        return stat
    Kh = max(stat.shape[1], idx.shape[1])
    stat = jnp.broadcast_to(stat, (stat.shape[0], Kh, stat.shape[2]))
    return _take(stat, jnp.broadcast_to(idx, (*stat.shape[:2], idx.shape[-1])), valid, capacity, True)


def to_pool(cache: KVCache, stat=None) -> tuple[PooledKVCache, jax.Array | None]:
    """A head-major KV cache as a pool of K x S entries (head by head), and its statistic `[B,1,K*S]`."""
    B, K, S, H = cache.k.shape
    pos = cache.pos if cache.pos.ndim == 3 else jnp.broadcast_to(cache.pos[:, None], (B, K, S))
    pooled = PooledKVCache(
        k=cache.k.reshape(B, K * S, H),
        v=cache.v.reshape(B, K * S, H),
        pos=pos.reshape(B, K * S),
        head=jnp.broadcast_to(jnp.repeat(jnp.arange(K, dtype=jnp.int32), S)[None], (B, K * S)),
        length=cache.length * K,
    )
    if stat is not None:
        stat = jnp.broadcast_to(stat, (B, K, S)).reshape(B, 1, K * S)
    return pooled, stat


def _kept_mask(idx, valid, S: int):
    B, Kh, _ = idx.shape
    return jnp.zeros((B, Kh, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(Kh)[None, :, None], idx].max(valid)


def _weighted_merge(x, kept, target, weight):
    """x `[B,K,S,H]`: each kept slot t becomes (x_t + sum_{e -> t} w_e x_e) / (1 + sum w_e) over the
    evicted slots e with target[e] = t (weight 0 elsewhere)."""
    B, K, S, _ = x.shape
    w = jnp.where(kept, 0.0, weight)
    rows, heads = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
    added = jnp.zeros(x.shape, jnp.float32).at[rows, heads, target].add(w[..., None] * x.astype(jnp.float32))
    total = jnp.zeros((B, K, S), jnp.float32).at[rows, heads, target].add(w)
    merged = (x.astype(jnp.float32) + added) / (1.0 + total)[..., None]
    return jnp.where(kept[..., None], merged, x.astype(jnp.float32)).astype(x.dtype)


def merge_cam(cache: KVCache, idx, valid, attention: jax.Array) -> KVCache:
    """CaM-style value merge (module docstring); `attention` is the scorer's statistic `[B,Kh,S]`."""
    B, K, S, _ = cache.v.shape
    kept = jnp.broadcast_to(_kept_mask(idx, valid, S), (B, K, S))
    slots = jnp.arange(S)[None, None, :]
    following = jax.lax.cummin(jnp.where(kept, slots, S), axis=2, reverse=True)
    preceding = jax.lax.cummax(jnp.where(kept, slots, -1), axis=2)
    target = jnp.where(following < S, following, jnp.maximum(preceding, 0))
    a = jnp.broadcast_to(attention, (B, K, S))
    a_t = jnp.take_along_axis(a, target, axis=2)
    pos = cache.pos if cache.pos.ndim == 3 else cache.pos[:, None]
    weight = jnp.where(pos >= 0, jnp.minimum(1.0, a / jnp.maximum(a_t, 1e-30)), 0.0)
    return cache.replace(v=_weighted_merge(cache.v, kept, target, weight))


def merge_kvmerger(cache, idx, valid, sigma: float):
    """KVMerger-style merge (module docstring) for a KV cache or an MLA latent cache (whose latent c
    plays the key and is merged with its RoPE key)."""
    if isinstance(cache, LatentCache):
        c = cache.c[:, None]
        merged = _kvmerger(c, (c, cache.k_rope[:, None]), cache.pos[:, None], idx, valid, sigma)
        return cache.replace(c=merged[0][:, 0], k_rope=merged[1][:, 0])
    pos = cache.pos if cache.pos.ndim == 3 else cache.pos[:, None]
    k, v = _kvmerger(cache.k, (cache.k, cache.v), jnp.broadcast_to(pos, cache.k.shape[:3]), idx, valid, sigma)
    return cache.replace(k=k, v=v)


def _kvmerger(keys, arrays, pos, idx, valid, sigma):
    """Merge each evicted slot of `arrays` (head-major) into the kept slot whose key is most similar."""
    B, K, S, _ = keys.shape
    kept = jnp.broadcast_to(_kept_mask(idx, valid, S), (B, K, S))
    u = keys.astype(jnp.float32)
    u = u / jnp.maximum(jnp.linalg.norm(u, axis=-1, keepdims=True), 1e-12)
    sim = jnp.einsum("BKSH,BKTH->BKST", u, u)
    sim = jnp.where(kept[:, :, None, :], sim, -jnp.inf)
    target = jnp.argmax(sim, axis=-1)
    best = jnp.take_along_axis(sim, target[..., None], axis=-1)[..., 0]
    weight = jnp.where(pos >= 0, jnp.exp(-(2.0 - 2.0 * best) / (2 * sigma**2)), 0.0)
    return tuple(_weighted_merge(x, kept, target, weight) for x in arrays)


class Reducer:
    """A reducer: its `Options`, whether it weighs merges by attention (`needs_attention`: the scorer
    must observe queries), whether it applies to an MLA latent (`mla`), and `merge`, which folds the
    evicted slots into the kept ones before they are gathered (`select`: nothing)."""

    name: str
    Options: type[Options] = Options
    needs_attention = False
    mla = True

    def merge(self, cache, idx, valid, stat, options):
        return cache


class Select(Reducer):
    name = "select"


class CaM(Reducer):
    name = "cam"
    needs_attention = True
    mla = False  # an MLA latent has no separate values

    def merge(self, cache, idx, valid, stat, options):
        return merge_cam(cache, idx, valid, stat)


class KVMerger(Reducer):
    name = "kvmerger"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        sigma: float = 1.0  # Gaussian kernel width over unit-key distances

        def check(self, where: str) -> None:
            if self.sigma <= 0:
                raise ConfigError(f"{where}: sigma={self.sigma} must be > 0")

    def merge(self, cache, idx, valid, stat, options):
        return merge_kvmerger(cache, idx, valid, options.sigma)


REDUCERS = {r.name: r for r in (Select(), CaM(), KVMerger())}

"""Scorers: how much each cached slot matters, `[B,Kh,S]` aligned with the cache's slots (Kh = K when
heads score on their own, 1 when one score serves every head). Higher is kept.

Attention-based scorers work in two parts: `observe` reduces the attention probabilities `[B,K,W,G,S]`
of some queries (the model computes them, `Decoder.observe`) to a per-slot statistic while the
model runs; `score` turns that statistic (or the cache alone) into scores when the reducer runs.
- StreamingLLM (Xiao et al. 2024, arXiv 2309.17453): recency; the reducer keeps the sinks and the
  most recent tokens, so the score is the position.
- H2O (Zhang et al. 2023, arXiv 2306.14048, sec. 3.2): the attention each key has received, summed
  over every query so far (prefill and decode); `normalize` divides by the number of queries that
  could see the key, as kvpress's observed-attention press does.
- SnapKV (Li et al. 2024, arXiv 2404.14469, eqs. in sec. 4.2): attention of the last `obs_window`
  prompt queries, summed, averaged over the query heads of each KV head, then pooled over
  neighbouring slots with a 1-D kernel (average, kernel 5, zero padded as F.avg_pool1d). As in the
  reference code, only the keys before the window are pooled (the window's own slots count as the
  zero padding), so attention paid to window keys never leaks into the slots next to them.
- TOVA (Oren et al. 2024, arXiv 2401.06104): the last query's attention averaged over all heads.
- Key norm (Devoto et al. 2024, arXiv 2406.11430): keys with a low L2 norm draw attention; keep the
  lowest norms (score = -||k||).
- Scissorhands (Liu et al. 2023, arXiv 2305.17118, alg. 1-2, "persistence of importance"): over a
  history window of the last `obs_window` queries, count how often each token's attention was below
  the average 1/n (n the tokens that query could see), summed over the head's query group; tokens
  with the most such counts go first (score = -count; ties keep the newer token). During decoding
  (`every=`) the counts keep accumulating over every decode query (the paper slides the window).
A pooled cache (AdaKV) scores entries `[B,1,P]`; SnapKV pools each entry with its own head's entries
in position order (`pool_by_head`), which at prefill is exactly the per-head pooling of the dense
layout (what AdaKV's and kvpress's code pool before flattening the heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache import LatentCache, PooledKVCache
from kvjax.compress.policy import Stage

ATTENTION_SCORERS = ("h2o", "snapkv", "tova", "d2o", "scissorhands")  # D2O scores as H2O does


def observed_queries(stage: Stage, length: int) -> int:
    """How many of the last prompt queries a stage observes (0: none; `length`: all)."""
    window = min(stage.obs_window, length)  # SnapKV's voters, ThinK's queries, Scissorhands' history
    return {"h2o": length, "d2o": length, "snapkv": window, "think": window, "scissorhands": window, "tova": 1}.get(
        stage.method, 0
    )


def observe(stage: Stage, probs: jax.Array, obs_pos: jax.Array, pooled: bool, visible=None) -> jax.Array | None:
    """Reduce probabilities `[B,K,W,G,S]` of queries at positions obs_pos `[B,W]` (-1: none) to the
    stage's per-slot statistic `[B,Kh,S]`, or None for scorers that do not read attention. `visible`
    (broadcastable to probs): which keys each query could see (Scissorhands' 1/n)."""
    if stage.method not in ATTENTION_SCORERS:
        return None
    last = jnp.max(obs_pos, axis=1)[:, None]
    window = {"h2o": None, "d2o": None, "snapkv": stage.obs_window, "scissorhands": stage.obs_window, "tova": 1}[
        stage.method
    ]
    voter = obs_pos >= 0 if window is None else (obs_pos >= 0) & (obs_pos > last - window)  # [B,W]
    if stage.method == "scissorhands":
        n = jnp.maximum(jnp.sum(visible, axis=-1, keepdims=True), 1)
        probs = (visible & (probs < 1.0 / n)).astype(jnp.float32)  # below this query's average
        per_query = jnp.where(voter[:, None, :, None, None], probs, 0.0).sum(axis=(2, 3))
        return per_query.sum(axis=1, keepdims=True) if pooled else per_query
    per_query = jnp.where(voter[:, None, :, None, None], probs, 0.0).sum(axis=2).mean(axis=2)  # [B,K,S]
    if stage.method == "tova" or pooled:  # pooled: only an entry's own head has non-zero probabilities
        reduce = jnp.mean if stage.method == "tova" and not pooled else jnp.sum
        return reduce(per_query, axis=1, keepdims=True)
    return per_query


def score(stage: Stage, cache, stat: jax.Array | None, last_pos: jax.Array) -> jax.Array:
    """Scores `[B,Kh,S]` of a cache's slots (KVCache, PooledKVCache or LatentCache)."""
    pos = cache.pos if cache.pos.ndim == 3 else cache.pos[:, None, :]
    if stage.method == "streaming":
        return pos.astype(jnp.float32)
    if stage.method == "keynorm":
        if isinstance(cache, LatentCache):
            raise ValueError("keynorm scores per-head keys; an MLA cache stores a latent, not keys")
        k = cache.k[:, None] if isinstance(cache, PooledKVCache) else cache.k
        return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)
    if stat is None:
        raise ValueError(f"scorer {stage.method!r} needs an attention observation")
    if stage.method == "h2o" and stage.normalize:
        seen = jnp.maximum(last_pos[:, None, None] - pos + 1, 1)
        return stat / seen
    if stage.method == "scissorhands":  # fewest below-average counts first; ties keep the newer token
        return -stat + 0.5 * pos / (jnp.max(pos) + 1.0)
    if stage.method == "snapkv":
        in_window = pos > (last_pos[:, None, None] - stage.obs_window)  # kept anyway; pooled as padding
        stat = jnp.where(in_window, 0.0, stat)
        if isinstance(cache, PooledKVCache):
            return pool_by_head(stat, cache.head[:, None], pos, stage.kernel, stage.pooling)
        return pool(stat, stage.kernel, stage.pooling)
    return stat


def pool(x: jax.Array, kernel: int, how: str) -> jax.Array:
    """Centred 1-D pooling over the last axis with zero padding (avg counts the padding, as torch's
    avg_pool1d with count_include_pad)."""
    pad = kernel // 2
    init, op = (0.0, jax.lax.add) if how == "avg" else (-jnp.inf, jax.lax.max)
    dims = (1,) * (x.ndim - 1) + (kernel,)
    padding = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    out = jax.lax.reduce_window(x, init, op, dims, (1,) * x.ndim, padding)
    return out / kernel if how == "avg" else out


def pool_by_head(x: jax.Array, head: jax.Array, pos: jax.Array, kernel: int, how: str) -> jax.Array:
    """`pool` over the entries of a pool `[B,1,P]`: each entry with the entries of its own head that
    neighbour it in position order; other heads' entries and empty ones count as the zero padding."""
    order = jnp.lexsort((pos, head), axis=-1)  # by head, then position
    xs, hs, ps = (jnp.take_along_axis(a, order, axis=-1) for a in (x, head, pos))
    half = kernel // 2
    fill = 0.0 if how == "avg" else -jnp.inf
    widths = ((0, 0),) * (x.ndim - 1) + ((half, half),)
    xp = jnp.pad(xs, widths, constant_values=fill)
    hp, pp = jnp.pad(hs, widths, constant_values=-1), jnp.pad(ps, widths, constant_values=-1)
    P = x.shape[-1]
    parts = [
        jnp.where((hp[..., o : o + P] == hs) & (pp[..., o : o + P] >= 0), xp[..., o : o + P], fill)
        for o in range(kernel)
    ]
    out = sum(parts) / kernel if how == "avg" else functools.reduce(jnp.maximum, parts)
    return jnp.take_along_axis(out, jnp.argsort(order, axis=-1), axis=-1)  # back to the pool's order

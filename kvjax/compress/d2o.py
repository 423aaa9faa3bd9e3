"""D2O (Wan et al. 2024, arXiv 2406.13035), as the reference code `d2o/LLM_merge_new` runs it: H2O's
accumulated-attention eviction at every decode step, with

- **layer budgets from attention density** (sec. 3.1): per layer, the variance over keys of each
  head's column sums of the prefill attention, min-max normalised across the layer's heads (+1e-6)
  and averaged, sigma_l; w = softmax(-sigma) over the layers; the layer keeps r_l = clamp(w_l x L x
  rho, 0.01, 1) of the T' = prompt + 1 tokens, half heavy hitters and half recent (rho: the kept
  fraction). The first two and the last layer are never compressed. Dense layers (low variance) keep
  more.
- **merging of evicted tokens** (sec. 3.2): each evicted key's most similar kept key (cosine) per head,
  u_e its similarity; a per-layer threshold tau, the mean of u on the first eviction and then
  tau <- ema x tau + (1 - ema) x mean(u); an evicted token is merged when its u averaged over the
  heads reaches tau, into k_c <- (k_c + sum u_e k_e) / (1 + n_c) (the reference's scatter_reduce
  'mean' with include_self; values alike with the keys' u and targets). Merged tokens' scores stay.

Deviations: heads are KV heads (their query heads' attention averaged), since the reference code
assumes MHA; the first eviction runs right after the prefill (the reference evicts at the first decode
step, after adding that query's attention); tau is kept per sequence (the reference: one per layer
for a batch of one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import KVCache
from kvjax.compress.reducers import _kept_mask

PROTECTED_EDGE = (0, 1, -1)  # cache indices never compressed: the first two and the last layer
SINKS = 4  # first positions always kept (the reference forces 0-3 into the heavy hitters)


@struct.dataclass
class D2OKVCache(KVCache):
    """A KV cache that also carries its layer's merge threshold tau `[B]` (NaN before the first merge)."""

    tau: jax.Array = None


def layer_sigma(stat: jax.Array, pos: jax.Array) -> jax.Array:
    """sigma `[B]` of one layer from its prefill column sums `[B,K,S]` over the keys at pos `[B,S]`."""
    valid = (pos >= 0)[:, None, :]
    n = jnp.maximum(valid.sum(-1), 2)
    mean = jnp.where(valid, stat, 0).sum(-1) / n
    var = jnp.where(valid, (stat - mean[..., None]) ** 2, 0).sum(-1) / (n - 1)  # unbiased, as torch.var
    lo, hi = var.min(axis=1, keepdims=True), var.max(axis=1, keepdims=True)
    return ((var - lo) / (hi - lo + 1e-6)).mean(axis=1)


def layer_counts(sigma: np.ndarray, lengths: np.ndarray, keep: float, never: int) -> np.ndarray:
    """Tokens each layer keeps per row `[L,B]` from sigma `[L,B]` (rows of `lengths` tokens, `keep` the
    mean kept fraction rho): 2 x int(T' r_l / 2), T' = length + 1, and at least the sinks twice over (the
    reference can leave a layer empty at r_l = 0.01); protected layers keep `never`."""
    sigma = np.asarray(sigma, np.float64)
    L = sigma.shape[0]
    w = np.exp(-sigma - (-sigma).max(axis=0))
    w = w / w.sum(axis=0)
    ratio = np.clip(w * L * keep, 0.01, 1.0)
    half = (np.asarray(lengths)[None, :] + 1) * ratio / 2
    counts = np.maximum(2 * np.floor(half + 1e-9).astype(np.int64), 2 * SINKS)
    counts[protected_layers(L)] = never
    return counts


def protected_layers(n: int) -> list[int]:
    """Which of `n` compressible caches D2O never compresses (`PROTECTED_EDGE`, those there are)."""
    return sorted({layer % n for layer in PROTECTED_EDGE if -n <= layer < n})


def merge(cache, idx, valid, ema: float, evicts: int | None = None) -> D2OKVCache:
    """Merge the evicted slots of a head-major cache into their most similar kept ones (module docstring)
    and update tau; idx, valid `[B,K,C]` are the kept slots. `evicts`: the most slots a head evicts (a
    decode step's re-selection: one), so that only those slots are compared with the kept ones, `[E,S]`
    similarities a head instead of `[S,S]`; None: any number (a prompt's)."""
    B, K, S, _ = cache.k.shape
    tau = cache.tau if isinstance(cache, D2OKVCache) else jnp.full((B,), jnp.nan, jnp.float32)
    pos = cache.pos if cache.pos.ndim == 3 else jnp.broadcast_to(cache.pos[:, None], (B, K, S))
    kept = jnp.broadcast_to(_kept_mask(idx, valid, S), (B, K, S))
    evicted = (pos >= 0) & ~kept
    u = cache.k.astype(jnp.float32)
    u = u / jnp.maximum(jnp.linalg.norm(u, axis=-1, keepdims=True), 1e-12)
    rows, heads = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
    if evicts is None or evicts >= S:
        source = jnp.broadcast_to(jnp.arange(S), (B, K, S))  # every slot a candidate, [B,K,E=S]
    else:  # the evicted slots first (lowest index first), then kept ones, masked out below
        source = jax.lax.top_k(evicted.astype(jnp.int32), evicts)[1]
    gone = jnp.take_along_axis(evicted, source, axis=-1)  # [B,K,E]: evicted
    sim = jnp.einsum("BKEH,BKTH->BKET", jnp.take_along_axis(u, source[..., None], axis=2), u)
    sim = jnp.where(kept[:, :, None, :], sim, -jnp.inf)
    target = jnp.argmax(sim, axis=-1)  # [B,K,E]
    best = jnp.where(gone, jnp.take_along_axis(sim, target[..., None], axis=-1)[..., 0], 0)
    best = jnp.zeros((B, K, S), jnp.float32).at[rows, heads, source].add(best)  # back at the slots, 0 elsewhere
    n_evicted = evicted.sum(axis=(1, 2))
    mean_u = best.sum(axis=(1, 2)) / jnp.maximum(n_evicted, 1)
    new_tau = jnp.where(jnp.isnan(tau), mean_u, ema * tau + (1 - ema) * mean_u)
    new_tau = jnp.where(n_evicted > 0, new_tau, tau)
    head_mean = best.sum(axis=1) / jnp.maximum(evicted.sum(axis=1), 1)  # [B,S]
    chosen = gone & (head_mean[rows, source] >= new_tau[:, None, None])
    weight = jnp.where(chosen, best[rows, heads, source], 0.0)
    count = jnp.zeros((B, K, S), jnp.float32).at[rows, heads, target].add(chosen.astype(jnp.float32))

    def merged(x):
        moved = jnp.take_along_axis(x, source[..., None], axis=2).astype(jnp.float32)
        added = jnp.zeros(x.shape, jnp.float32).at[rows, heads, target].add(weight[..., None] * moved)
        out = (x.astype(jnp.float32) + added) / (1.0 + count)[..., None]
        return jnp.where(kept[..., None], out, x.astype(jnp.float32)).astype(x.dtype)

    fields = {f: getattr(cache, f) for f in ("pos", "length")}
    return D2OKVCache(k=merged(cache.k), v=merged(cache.v), **fields, tau=new_tau)

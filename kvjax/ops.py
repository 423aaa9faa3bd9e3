"""The one attention op every attention mixer calls.

GQA groups the queries (`[B,T,K,G,H]`) instead of repeating K/V in memory, and the mask is computed from
positions alone: a key is visible when `0 <= k_pos <= q_pos` and, with a sliding window,
`q_pos - k_pos < window`. Logits and softmax are computed in fp32.

Keys and values are head-major, `[B,K,S,H]`, the layout caches store: both einsums are then plain batched
matmuls over (B, K). With token-major `[B,S,K,H]`, XLA:CPU copies the whole cache into head-major order
before each dot, and a decode step's attention took 4.5x its memory-read floor instead of 1.8x
(scripts/bench_decode.py model, batch 8, 2048 tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("xla",)
# Finite, so a fully masked row (a padding query) cannot produce NaN; its probabilities are then zeroed,
# so it outputs 0 and every masked key gets exactly zero probability and zero gradient.
_MASKED = -1e30


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None = None) -> jax.Array:
    """Boolean mask `[B,T,S]`: which keys each query may attend to, from positions alone."""
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask


def _check(q, k, v, q_pos, k_pos, window, impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} must be one of {IMPLS}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {q.shape} must be [B,T,N,H]; k {k.shape} [B,K,S,H] and v {v.shape} [B,K,S,Hv]")
    (B, T, N, H), (Bk, K, S, Hk) = q.shape, k.shape
    if B != Bk or H != Hk:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    if q_pos.shape != (B, T) or k_pos.shape != (B, S):
        raise ValueError(f"q_pos {q_pos.shape} must be {(B, T)} and k_pos {k_pos.shape} must be {(B, S)}")
    if window is not None and window <= 0:
        raise ValueError(f"window={window} must be > 0 or None")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """softmax(q k^T * scale, masked by positions) v, for q `[B,T,N,H]`, k `[B,K,S,H]`, v `[B,K,S,Hv]`.

    Returns `[B,T,N,Hv]` in q's dtype; a query that sees no key (padding) gets zeros. `scale` defaults
    to 1/sqrt(H).
    """
    _check(q, k, v, q_pos, k_pos, window, impl)
    B, T, N, H = q.shape
    K = k.shape[1]
    scale = H**-0.5 if scale is None else scale
    q_BTKGH = q.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("BTKGH,BKSH->BKTGS", q_BTKGH, k, preferred_element_type=jnp.float32) * scale
    return attend(masked_softmax(logits, q_pos, k_pos, window), v).astype(q.dtype)


def masked_softmax(logits: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int | None = None) -> jax.Array:
    """Attention probabilities from fp32 logits `[B,K,T,G,S]`, masked by positions (`visible`); a query
    that sees no key gets all zeros."""
    # Every [.., T, G, S] tensor is in the order the dot emits; asking for [.., G, T, S] made XLA:CPU
    # transpose the logits inside each mask op (half of a 2k-token prefill's time).
    # jax.nn.softmax rather than a hand-fused one: its backward rule kept training 1.6-2x faster.
    mask = visible(q_pos, k_pos, window)[:, None, :, None, :]  # [B,1,T,1,S]
    return jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, _MASKED), axis=-1), 0.0)


def attend(probs: jax.Array, v: jax.Array) -> jax.Array:
    """Probabilities `[B,K,T,G,S]` times values `[B,K,S,Hv]` -> `[B,T,K*G,Hv]` (query heads grouped by K)."""
    B, K, T, G, _ = probs.shape
    # Output in the dot's natural order, then transposed (a T-sized copy): asking the einsum for
    # BTKGH directly made XLA:CPU pick a 9x slower dot.
    out_BKTGH = jnp.einsum("BKTGS,BKSH->BKTGH", probs.astype(v.dtype), v)
    return out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, v.shape[-1])

"""Rotary position embedding (Su et al. 2021, eq. 34), shared by the attention layers and by caches that
store pre-RoPE keys (KVQuant-style quantization rotates after dequantizing).

Uses the half-split pairing (channel i with i + H/2) of the Hugging Face Llama code, so that converted
checkpoints load without permuting weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def frequencies(pairs, head_dim: int, theta: float) -> jax.Array:
    """Inverse frequencies theta^(-2k / head_dim) of the pairs k (any array of pair indices)."""
    return 1.0 / theta ** (jnp.asarray(pairs, jnp.float32) * 2.0 / head_dim)


def rotate(x: jax.Array, pos: jax.Array, theta: float, inv_freq: jax.Array | None = None) -> jax.Array:
    """x `[..., H]` rotated by positions `pos` of shape x.shape[:-1] (or broadcastable to it); a negative
    position rotates back. `inv_freq` (of rank pos.ndim + 1, broadcastable to `[..., H/2]`) replaces the
    standard frequencies of an H-dim RoPE, e.g. with a subset of a wider head's pairs (`frequencies`)."""
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_freq = frequencies(jnp.arange(half), x.shape[-1], theta).reshape((1,) * pos.ndim + (half,))
    angle = pos.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """RoPE for x `[B,T,N,H]` at positions `[B,T]` (every head alike)."""
    return rotate(x, pos[:, :, None], theta)

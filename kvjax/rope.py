"""Rotary position embedding (Su et al. 2021, eq. 34), shared by the attention layers and by caches that
store pre-RoPE keys (KVQuant-style quantization rotates after dequantizing).

Uses the half-split pairing (channel i with i + H/2) of the Hugging Face Llama code, so that converted
checkpoints load without permuting weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotate(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """x `[..., H]` rotated by positions `pos` of shape x.shape[:-1] (or broadcastable to it); a negative
    position rotates back."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angle = pos.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * pos.ndim + (half,))
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """RoPE for x `[B,T,N,H]` at positions `[B,T]` (every head alike)."""
    return rotate(x, pos[:, :, None], theta)

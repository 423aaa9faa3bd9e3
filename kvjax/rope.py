"""Rotary position embedding (Su et al. 2021, eq. 34), shared by the attention layers and by caches that
store pre-RoPE keys (KVQuant-style quantization rotates after dequantizing).

Uses the half-split pairing (channel i with i + H/2) of the Hugging Face Llama code, so that converted
checkpoints load without permuting weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_DIGIT_BITS = 11  # rotate_exact splits |pos| into three digits of this many bits (every int32)


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
    return _turn(x, jnp.cos(angle), jnp.sin(angle))


def _turn(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Channel i paired with i + H/2, each pair turned by its angle's cos and sin `[..., H/2]`."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@functools.cache
def _digit_tables(head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[3, 2^11, H/2]` of d * 2^(11 i) * inv_freq for each digit value d of digit i, in float64."""
    inv = 1.0 / theta ** (np.arange(head_dim // 2) * 2.0 / head_dim)
    digits = np.arange(2**_DIGIT_BITS, dtype=np.float64)
    angle = digits[None, :, None] * (2.0 ** (_DIGIT_BITS * np.arange(3)))[:, None, None] * inv
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate_exact(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """`rotate` with angles looked up instead of computed: |pos| split into three 11-bit digits, the
    cos/sin of each digit's angle read from float64-built tables and combined by angle addition. For
    caches that rotate every slot at every step (KVQuant-style and low-rank caches re-rotate stored
    pre-RoPE keys): XLA:CPU's cos/sin of large fp32 angles cost about ten times the table path per
    re-rotated layer (a one-off timing of both on a SmolLM2 layer at 8k slots when this was written;
    `scripts/bench_compression.py --policy kvquant:4` times the decode step that uses it). The angles
    are exact to fp32 rounding, where `rotate`'s fp32 product p * inv_freq is off by up to ~1e-3 rad at
    p ~ 8k; a cache must therefore un-rotate with this function too, so that un-rotating and re-rotating
    a key give back the model's key."""
    cos_t, sin_t = _digit_tables(x.shape[-1], float(theta))
    p = pos.astype(jnp.int32)
    mag = jnp.abs(p)
    cos = sin = None
    for i in range(3):
        d = (mag >> (_DIGIT_BITS * i)) & (2**_DIGIT_BITS - 1)
        c, s = jnp.asarray(cos_t[i])[d], jnp.asarray(sin_t[i])[d]
        cos, sin = (c, s) if cos is None else (cos * c - sin * s, sin * c + cos * s)
    return _turn(x, cos, jnp.where(p[..., None] < 0, -sin, sin))


def rotate_slots(k: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """`rotate_exact` of head-major keys `[B,K,S,H]` at cache positions `[B,S]` (shared by the KV heads)
    or `[B,K,S]` (per head, after head-wise eviction)."""
    return rotate_exact(k, pos[:, None] if pos.ndim == 2 else pos, theta)


def llama3_frequencies(head_dim: int, theta: float, scaling) -> np.ndarray:
    """Llama 3.1's inverse frequencies `[H/2]` (`RopeScaling`): long wavelengths divided by the factor,
    short ones kept, the band between them interpolated by how many wavelengths fit the original context."""
    inv = 1.0 / theta ** (np.arange(head_dim // 2) * 2.0 / head_dim)
    wavelength = 2 * np.pi / inv
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = np.clip((scaling.original_max_positions / wavelength - low) / (high - low), 0.0, 1.0)
    return ((1 - smooth) * inv / scaling.factor + smooth * inv).astype(np.float32)


def apply_rope(x: jax.Array, pos: jax.Array, theta: float, scaling=None) -> jax.Array:
    """RoPE for x `[B,T,N,H]` at positions `[B,T]` (every head alike); `scaling` a `RopeScaling`."""
    if scaling is None:
        return rotate(x, pos[:, :, None], theta)
    inv = jnp.asarray(llama3_frequencies(x.shape[-1], theta, scaling)).reshape(1, 1, 1, -1)
    return rotate(x, pos[:, :, None], theta, inv)

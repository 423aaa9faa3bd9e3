"""Uniform quantizers over groups of the last axis: symmetric (codes centred on 2^(b-1), one scale per
group) and asymmetric min-max (a scale and a zero point, the minimum, per group; KIVI's choice).

Round-trip error bounds (tested): symmetric |x - x'| <= max|x| / (2 (2^(b-1) - 1)); asymmetric
|x - x'| <= (max x - min x) / (2 (2^b - 1)), both per group (plus float rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _grouped(x: jax.Array, group: int) -> jax.Array:
    if x.shape[-1] % group:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of the group size {group}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)


def quantize(x: jax.Array, bits: int, group: int, *, symmetric: bool):
    """x `[..., D]` -> (codes uint8 `[..., D]`, scale `[..., D / group]`, zero `[..., D / group]` or None)."""
    g = _grouped(x, group)
    if symmetric:
        top = 2 ** (bits - 1) - 1
        scale = jnp.abs(g).max(axis=-1, keepdims=True) / top
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = jnp.clip(jnp.round(g / safe), -top, top) + 2 ** (bits - 1)
        return codes.astype(jnp.uint8).reshape(x.shape), scale[..., 0], None
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    scale = (hi - lo) / (2**bits - 1)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round((g - lo) / safe), 0, 2**bits - 1)
    return codes.astype(jnp.uint8).reshape(x.shape), scale[..., 0], lo[..., 0]


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array | None, bits: int, group: int) -> jax.Array:
    """The inverse of `quantize` (fp32 `[..., D]`); a None zero point means symmetric codes."""
    g = _grouped(codes, group)
    s = scale.astype(jnp.float32)[..., None]
    if zero is None:
        out = (g - 2 ** (bits - 1)) * s
    else:
        out = g * s + zero.astype(jnp.float32)[..., None]
    return out.reshape(codes.shape)

"""Bit packing: 2-, 4- or 8-bit unsigned codes stored 8 // bits to a uint8, so that a cache's `nbytes()`
shows the real saving. Codes are packed along the last axis, little end first (code j of a byte sits
at bits [j * bits, (j + 1) * bits))."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = (2, 4, 8)


def _check(bits: int, n: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits={bits} must be one of {BITS}")
    per = 8 // bits
    if n % per:
        raise ValueError(f"the last axis ({n}) must be a multiple of {per} to pack {bits}-bit codes")
    return per


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes in [0, 2^bits) `[..., D]` -> uint8 `[..., D * bits / 8]`."""
    per = _check(bits, codes.shape[-1])
    grouped = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).reshape((1,) * (grouped.ndim - 1) + (per,))
    # the shifted codes occupy disjoint bits, so their sum is their bitwise or
    return jnp.left_shift(grouped, shifts).sum(axis=-1, dtype=jnp.uint8)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """uint8 `[..., D * bits / 8]` -> codes uint8 `[..., D]` (the inverse of `pack`)."""
    per = 8 // bits
    _check(bits, per * packed.shape[-1])
    if per == 1:
        return packed
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).reshape((1,) * packed.ndim + (per,))
    mask = jnp.uint8((1 << bits) - 1)
    codes = jnp.right_shift(packed[..., None], shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)

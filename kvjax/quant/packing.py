"""Bit packing: 2-, 3-, 4- or 8-bit unsigned codes stored densely in uint8 (four 2-bit or two 4-bit
codes per byte, eight 3-bit codes per 3 bytes), so that a cache's `nbytes()` shows the real saving.
Codes are packed along the last axis, little end first (code j of a group sits at bits
[j * bits, (j + 1) * bits) of the group's little-endian integer)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BITS = (2, 3, 4, 8)


def _group(bits: int, n: int) -> tuple[int, int]:
    """(codes, bytes) per packed group; checks that the last axis (n codes) is whole groups."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} must be one of {BITS}")
    width = math.lcm(8, bits)
    codes = width // bits
    if n % codes:
        raise ValueError(f"the last axis ({n}) must be a multiple of {codes} to pack {bits}-bit codes")
    return codes, width // 8


def packed_width(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits take."""
    codes, nbytes = _group(bits, n)
    return n // codes * nbytes


def _shifts(n: int, step: int, ndim: int) -> jax.Array:
    """[0, step, 2 step, ...] (n of them) shaped to broadcast over the last axis of an ndim array."""
    return (jnp.arange(n, dtype=jnp.uint32) * step).reshape((1,) * (ndim - 1) + (n,))


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes in [0, 2^bits) `[..., D]` -> uint8 `[..., packed_width(D, bits)]`."""
    per, nbytes = _group(bits, codes.shape[-1])
    grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], -1, per)
    # the shifted codes occupy disjoint bits, so their sum is their bitwise or
    value = jnp.left_shift(grouped, _shifts(per, bits, grouped.ndim)).sum(axis=-1, dtype=jnp.uint32)
    out = jnp.right_shift(value[..., None], _shifts(nbytes, 8, grouped.ndim)) & 0xFF
    return out.astype(jnp.uint8).reshape(*codes.shape[:-1], -1)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """uint8 `[..., packed_width(D, bits)]` -> codes uint8 `[..., D]` (the inverse of `pack`)."""
    per, nbytes = _group(bits, math.lcm(8, bits) // bits)
    if packed.shape[-1] % nbytes:
        raise ValueError(f"a packed last axis of {packed.shape[-1]} bytes is not whole {bits}-bit groups")
    grouped = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], -1, nbytes)
    value = jnp.left_shift(grouped, _shifts(nbytes, 8, grouped.ndim)).sum(axis=-1, dtype=jnp.uint32)
    codes = jnp.right_shift(value[..., None], _shifts(per, bits, grouped.ndim)) & ((1 << bits) - 1)
    return codes.astype(jnp.uint8).reshape(*packed.shape[:-1], -1)

"""Bit packing: 2-, 3-, 4- or 8-bit unsigned codes stored densely in uint8 (four 2-bit or two 4-bit
codes per byte, eight 3-bit codes per 3 bytes), so that a cache's `nbytes()` shows the real saving.

2-, 4- and 8-bit codes are packed *plane-major* along the last axis: of n codes in W = n * bits / 8
bytes, byte b holds codes b, b + W, b + 2W, ... at bits [0, bits), [bits, 2 bits), ... So bit plane j,
`(byte >> j * bits) & mask`, is the contiguous run of codes [j W, (j + 1) W): a kernel unpacks a block
with shifts alone and dots each plane with a contiguous slice of the query, never interleaving lanes
(`pallas_kernels.quant_decode_attention`). 3-bit codes (8 per 3 bytes) are packed in groups, code j of
a group at bits [3 j, 3 j + 3) of the group's little-endian 24-bit integer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BITS = (2, 3, 4, 8)
PLANE_BITS = (2, 4, 8)  # the widths packed plane-major


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


def planes(bits: int) -> int:
    """Codes per byte of a plane-major packing (2-, 4- or 8-bit)."""
    if bits not in PLANE_BITS:
        raise ValueError(f"bits={bits}: only {PLANE_BITS}-bit codes are packed in bit planes")
    return 8 // bits


def _shifts(n: int, step: int, ndim: int, axis: int = -1) -> jax.Array:
    """[0, step, 2 step, ...] (n of them) shaped to broadcast along `axis` of an ndim array."""
    shape = [1] * ndim
    shape[axis] = n
    return (jnp.arange(n, dtype=jnp.uint32) * step).reshape(shape)


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes in [0, 2^bits) `[..., D]` -> uint8 `[..., packed_width(D, bits)]`."""
    per, nbytes = _group(bits, codes.shape[-1])
    if bits in PLANE_BITS:
        split = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], per, -1)  # [..., plane, byte]
        # the shifted planes occupy disjoint bits, so their sum is their bitwise or
        value = jnp.left_shift(split, _shifts(per, bits, split.ndim, -2)).sum(axis=-2, dtype=jnp.uint32)
        return value.astype(jnp.uint8)
    grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], -1, per)
    value = jnp.left_shift(grouped, _shifts(per, bits, grouped.ndim)).sum(axis=-1, dtype=jnp.uint32)
    out = jnp.right_shift(value[..., None], _shifts(nbytes, 8, grouped.ndim)) & 0xFF
    return out.astype(jnp.uint8).reshape(*codes.shape[:-1], -1)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """uint8 `[..., packed_width(D, bits)]` -> codes uint8 `[..., D]` (the inverse of `pack`)."""
    per, nbytes = _group(bits, math.lcm(8, bits) // bits)
    if bits in PLANE_BITS:
        value = packed.astype(jnp.uint32)[..., None, :]  # [..., 1, byte]
        codes = jnp.right_shift(value, _shifts(per, bits, value.ndim, -2)) & ((1 << bits) - 1)
        return codes.astype(jnp.uint8).reshape(*packed.shape[:-1], -1)
    if packed.shape[-1] % nbytes:
        raise ValueError(f"a packed last axis of {packed.shape[-1]} bytes is not whole {bits}-bit groups")
    grouped = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], -1, nbytes)
    value = jnp.left_shift(grouped, _shifts(nbytes, 8, grouped.ndim)).sum(axis=-1, dtype=jnp.uint32)
    codes = jnp.right_shift(value[..., None], _shifts(per, bits, grouped.ndim)) & ((1 << bits) - 1)
    return codes.astype(jnp.uint8).reshape(*packed.shape[:-1], -1)

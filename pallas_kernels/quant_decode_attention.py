"""Fused dequantize-attend decode: flash-decoding (split-K, see `decode_attention`) over a quantized
cache's packed codes, dequantizing each key/value block inside the kernel, so a decode step reads the
codes and scales and never an fp32 copy of the cache.

Codes are packed plane-major (`kvjax.quant.packing`): byte b of a token's W bytes holds channels
b, b + W, ... at bit planes 0, 1, ... So plane j, `(byte >> j * bits) & mask`, is channels
[j W, (j + 1) W) and the kernel needs shifts and contiguous slices only. With codes c, scale s and
zero z (symmetric codes: z = -2^(bits-1) s), a value is c s + z, and

- keys scaled **per token** (int): q . k_t = s_t sum_j q_j . c_tj + z_t sum(q), one dot per plane;
- keys scaled **per channel over groups of `key_group` tokens** (KIVI, Liu et al. 2024, sec. 3.2): in
  a block of one group, q . k_t = sum_j (q_j * s_j) . c_tj + sum_j (q_j . z_j): the scales fold into
  the query, once per block;
- values scaled **per token over channel groups** (int: one group; KIVI: groups of `value_group`
  channels): o_u = (p * s_g) . c_u + (p . z_g) for each run u of channels within one plane and group.

The full-precision residual (KIVI's recent tokens) is not in the codes: its split-K partials come
from `decode_partials` and merge through `combine`. Blocks: `block_size(S)` slots for per-token keys,
one key group for KIVI; splits as in `decode_attention`, kept to whole 128-slot (TPU lane) tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.backend import block_size, call_options, pad_to, padded_group, resolve
from kvjax.pallas_kernels.decode_attention import MAX_SPLITS
from kvjax.pallas_kernels.online_softmax import dot_t, start, walk

PLANE_BITS = (2, 4, 8)
_LANES = 128  # a TPU block's last dim: a multiple of this or the whole axis


def _plane(codes, j: int, bits: int):
    """Codes of bit plane j of int32 packed bytes, as fp32."""
    return ((codes >> (j * bits)) & ((1 << bits) - 1)).astype(jnp.float32)


def _quant_kernel(
    qpos_ref, q_ref, kc_ref, ks_ref, *refs, bits, key_group, value_group, unit, has_kz, has_vz, scale, block, window
):
    """One (row, KV head, split). q `[P,Gp,Wk]` (the query's channels by plane), key codes `[L,Wk]`,
    key scales `[1,L]` per token or `[L/key_group,H]` per channel (zeros likewise), value codes
    `[L,Wv]`, value scales `[n_groups,L]` (zeros likewise), key positions `[1,L]`; out o `[U,Gp,unit]`
    (runs of `unit` channels in channel order), m and l `[Gp,1]`."""
    refs = list(refs)
    kz_ref = refs.pop(0) if has_kz else None
    vc_ref, vs_ref = refs.pop(0), refs.pop(0)
    vz_ref = refs.pop(0) if has_vz else None
    kpos_ref, o_ref, m_ref, l_ref = refs
    P, offset = 8 // bits, 2.0 ** (bits - 1)
    Wk, Wv = q_ref.shape[-1], vc_ref.shape[-1]
    qs = [q_ref[j].astype(jnp.float32) * scale for j in range(P)]  # [Gp, Wk] each

    def logits(keys):
        codes = kc_ref[keys, :].astype(jnp.int32)
        if key_group is None:  # per token: scale the dot products' columns
            s = ks_ref[:, keys]
            z = kz_ref[:, keys] if has_kz else -offset * s
            dots = sum(dot_t(qs[j], _plane(codes, j, bits)) for j in range(P))
            return dots * s + sum(q.sum(axis=1, keepdims=True) for q in qs) * z
        row = pl.ds(jax.lax.div(keys.start, key_group), 1)  # the block is one key group: its scales fold into q
        total = 0.0
        for j in range(P):
            lanes = pl.ds(j * Wk, Wk)
            total += dot_t(qs[j] * ks_ref[row, lanes], _plane(codes, j, bits))
            total += (qs[j] * kz_ref[row, lanes]).sum(axis=1, keepdims=True)
        return total

    def weigh(keys, p):
        codes = vc_ref[keys, :].astype(jnp.int32) if unit == Wv else None
        out = []
        for u in range(o_ref.shape[0]):
            j, col = divmod(u * unit, Wv)
            g = pl.ds(u * unit // value_group, 1)
            s = vs_ref[g, keys]
            z = vz_ref[g, keys] if has_vz else -offset * s
            run = codes if codes is not None else vc_ref[keys, pl.ds(col, unit)].astype(jnp.int32)
            pv = jnp.dot(p * s, _plane(run, j, bits), preferred_element_type=jnp.float32)
            out.append(pv + (p * z).sum(axis=1, keepdims=True))
        return tuple(out)

    o0, m0, l0 = start(*o_ref.shape[1:])
    o, m, l = walk(
        kpos_ref.shape[1] // block,
        block,
        qpos_ref[...],
        kpos_ref,
        window,
        logits,
        weigh,
        ((o0,) * o_ref.shape[0], m0, l0),
    )
    for u, o_u in enumerate(o):
        o_ref[u] = o_u
    m_ref[...], l_ref[...] = m, l


def _splits(n_blocks: int, block: int, align: int) -> int:
    """Splits of n_blocks key blocks (about a quarter of them, at most MAX_SPLITS) into parts of a
    multiple of `align` slots; 1 (the whole axis) when none fits."""
    target = max(1, min(MAX_SPLITS, n_blocks // 4))
    fits = [c for c in range(1, target + 1) if n_blocks % c == 0 and (n_blocks // c * block) % align == 0]
    return max(fits, default=1)


def check(bits: int, head_dim: int, key_group: int | None, value_group: int, backend: str | None = None) -> None:
    """Raises ValueError naming the constraint when the kernel cannot take this layout."""
    if bits not in PLANE_BITS:
        raise ValueError(f"fused quantized decode: bits={bits} must be one of {PLANE_BITS} (plane-major codes)")
    W, unit = head_dim * bits // 8, min(head_dim * bits // 8, value_group)
    if head_dim % value_group or value_group % unit or (key_group is not None and key_group < 1):
        raise ValueError(f"fused quantized decode: head_dim={head_dim} must be whole value groups of {value_group}")
    if resolve(backend) == "triton":
        pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
        if (
            unit < 16
            or not pow2(W)
            or not pow2(head_dim // value_group)
            or (key_group and (key_group < 16 or not pow2(key_group)))
        ):
            raise ValueError(
                f"fused quantized decode on Triton: a plane of {W} bytes, value runs of {unit} channels, "
                f"{head_dim // value_group} value groups and key groups of {key_group} tokens must be powers "
                "of two, runs and key groups >= 16 (Triton's smallest dot)"
            )


def quant_decode_partials(
    q,
    k_codes,
    k_scale,
    k_zero,
    v_codes,
    v_scale,
    v_zero,
    q_pos,
    k_pos,
    *,
    bits: int,
    key_group: int | None,
    value_group: int,
    scale: float,
    window: int | None = None,
    backend: str | None = None,
):
    """Split-K partials (o `[B,K,C,Gp,H]`, m and l `[B,K,C,Gp,1]`, fp32; merge with `combine`) of one
    query per row over quantized keys and values.

    q `[B,K,G,H]`; k_codes, v_codes `[B,K,S,H*bits/8]` uint8, plane-major; k_scale (and k_zero, or None
    for symmetric codes) `[B,K,1,S]` per token, or `[B,K,S/key_group,H]` per channel over token groups;
    v_scale (v_zero) `[B,K,H/value_group,S]`; q_pos `[B]`; k_pos `[B,S]` or `[B,K,S]` (-1: no token).
    """
    B, K, G, H = q.shape
    S = k_codes.shape[2]
    check(bits, H, key_group, value_group, backend)
    if key_group is not None and S % key_group:
        raise ValueError(f"fused quantized decode: {S} slots must be whole key groups of {key_group}")
    P, Wk, Wv = 8 // bits, k_codes.shape[-1], v_codes.shape[-1]
    unit = min(Wv, value_group)
    block = block_size(S) if key_group is None else key_group
    S_pad = -(-S // block) * block
    Gp = padded_group(G)
    align = 1 if resolve(backend) != "tpu" else _LANES * (8 if key_group else 1)
    C = _splits(S_pad // block, block, align)
    L = S_pad // C
    per_head = k_pos.ndim == 3
    kpos = pad_to((k_pos[:, None] if k_pos.ndim == 2 else k_pos)[:, :, None, :].astype(jnp.int32), 3, S_pad, -1)
    q_planes = pad_to(q, 2, Gp).reshape(B, K, Gp, P, Wk).transpose(0, 1, 3, 2, 4)

    rows = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h, c: (b, h, c, 0))  # noqa: E731
    cols = lambda n: pl.BlockSpec((None, None, n, L), lambda b, h, c: (b, h, 0, c))  # noqa: E731
    key_scales = cols(1) if key_group is None else rows(L // key_group, H)
    arrays = [
        q_planes,
        pad_to(k_codes, 2, S_pad),
        pad_to(k_scale, 3 if key_group is None else 2, S_pad // (key_group or 1)),
    ]
    specs = [pl.BlockSpec((None, None, P, Gp, Wk), lambda b, h, c: (b, h, 0, 0, 0)), rows(L, Wk), key_scales]
    if k_zero is not None:
        arrays.append(pad_to(k_zero, 3 if key_group is None else 2, S_pad // (key_group or 1)))
        specs.append(key_scales)
    n_groups = v_scale.shape[2]
    arrays += [pad_to(v_codes, 2, S_pad), pad_to(v_scale, 3, S_pad)]
    specs += [rows(L, Wv), cols(n_groups)]
    if v_zero is not None:
        arrays.append(pad_to(v_zero, 3, S_pad))
        specs.append(cols(n_groups))
    specs.append(pl.BlockSpec((None, None, 1, L), lambda b, h, c: (b, h if per_head else 0, 0, c)))
    U = H // unit
    kernel = functools.partial(
        _quant_kernel,
        bits=bits,
        key_group=key_group,
        value_group=value_group,
        unit=unit,
        has_kz=k_zero is not None,
        has_vz=v_zero is not None,
        scale=scale,
        block=block,
        window=window,
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, C),
        in_specs=[pl.BlockSpec((None, None, 1, 1), lambda b, h, c: (b, 0, 0, 0)), *specs],
        out_specs=[
            pl.BlockSpec((None, None, None, U, Gp, unit), lambda b, h, c: (b, h, c, 0, 0, 0)),
            pl.BlockSpec((None, None, None, Gp, 1), lambda b, h, c: (b, h, c, 0, 0)),
            pl.BlockSpec((None, None, None, Gp, 1), lambda b, h, c: (b, h, c, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, C, U, Gp, unit), jnp.float32),
            jax.ShapeDtypeStruct((B, K, C, Gp, 1), jnp.float32),
            jax.ShapeDtypeStruct((B, K, C, Gp, 1), jnp.float32),
        ],
        name="kvjax_quant_decode_attention",
        **call_options(backend),
    )(q_pos.astype(jnp.int32).reshape(B, 1, 1, 1), *arrays, kpos)
    return o.transpose(0, 1, 2, 4, 3, 5).reshape(B, K, C, Gp, H), m, l

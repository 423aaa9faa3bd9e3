"""Decode attention (flash-decoding: Dao, Haziza, Massa and Sizov 2023, "Flash-Decoding for long-context
inference"): one query per row over a long head-major cache, split-K.

The keys of each (row, KV head) are cut into `splits` contiguous parts, one Pallas program each; a
program walks its part in blocks of `block` slots with the online softmax of FlashAttention-2 (a running
max m, normaliser l and unnormalised output o, fp32), skipping blocks whose keys are all invisible, and
writes (o, m, l). A combine step rescales the parts to the global max and divides: exactly softmax
attention. The query heads of one KV head (GQA's group, padded to `padded_group`) go through together,
so K/V are read once per KV head. Masks come from positions as in `kvjax.ops.visible`: a key is visible
when 0 <= k_pos <= q_pos (and q_pos - k_pos < window), so compressed caches, per-head positions `[B,K,S]`
after head-wise eviction, ring caches and padding rows (q_pos -1: all zeros out) need nothing special.

The logits may be a sum of parts (q1 . k1 + q2 . k2) and the values may be the first part's keys:
that is MLA's absorbed decode (`latent_decode_attention`), whose latent block is read once per step
for both. On Triton, feature dims are zero-padded to powers of two >= 16 (`backend.padded_features`).

Blocks: 128 slots (or the next power of two >= 16 for a shorter cache, padded with empty slots);
splits: the number of blocks / 4, at most 16, dividing them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.backend import MASKED, block_size, call_options, pad_to, padded_features, padded_group
from kvjax.pallas_kernels.online_softmax import dot_t, start, visible, walk, weighted

MAX_SPLITS = 16


def _decode_kernel(qpos_ref, *refs, n_parts, shared_values, scale, block, window):
    """One (row, KV head, split). refs: per logit part a query `[Gp,Hp]` and keys `[L,Hp]`, then the
    values `[L,Hv]` (absent when they are the first part's keys: MLA's latents), the key positions
    `[1,L]`, and the outputs o `[Gp,Hv]`, m and l `[Gp,1]`. q_pos is `[1,1]`."""
    parts = [(refs[2 * i], refs[2 * i + 1]) for i in range(n_parts)]
    v_ref = parts[0][1] if shared_values else refs[2 * n_parts]
    kpos_ref, o_ref, m_ref, l_ref = refs[-4:]
    queries = [q_ref[...].astype(jnp.float32) * scale for q_ref, _ in parts]
    q_pos = qpos_ref[...]

    def logits(keys):
        return sum(dot_t(q, k_ref[keys, :]) for q, (_, k_ref) in zip(queries, parts))

    o, m, l = walk(
        kpos_ref.shape[1] // block, block, q_pos, kpos_ref, window, logits, weighted(v_ref), start(*o_ref.shape)
    )
    o_ref[...], m_ref[...], l_ref[...] = o, m, l


def combine(o, m, l):
    """Merge split-K partials `o [...,C,G,Hv]`, `m, l [...,C,G,1]` over axis -3: rows with no visible key
    give zeros."""
    top = m.max(axis=-3, keepdims=True)
    w = jnp.exp(m - top)
    num, den = (o * w).sum(axis=-3), (l * w).sum(axis=-3)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _splits(n_blocks: int) -> int:
    target = max(1, min(MAX_SPLITS, n_blocks // 4))
    return max(c for c in range(1, target + 1) if n_blocks % c == 0)


def decode_partials(
    parts,
    v,
    q_pos,
    k_pos,
    *,
    scale: float,
    window: int | None = None,
    backend: str | None = None,
    block: int | None = None,
):
    """Split-K partials (o `[B,K,C,Gp,Hv]`, m and l `[B,K,C,Gp,1]`, fp32) of one query per row, for
    callers that merge them with other parts (`combine`). The logits are the sum over `parts` of
    q `[B,K,G,Hp]` . k `[B,K,S,Hp]`; v `[B,K,S,Hv]`, or None when the values are the first part's keys
    (MLA's absorbed decode: one latent read serves both)."""
    (B, K, G, _), S = parts[0][0].shape, parts[0][1].shape[2]
    block = block_size(S) if block is None else block
    S_pad = -(-S // block) * block
    Gp = padded_group(G)
    Hv_out = (parts[0][1] if v is None else v).shape[-1]  # before Triton's padding of the features
    parts = [(padded_features(q, backend), padded_features(k, backend)) for q, k in parts]
    arrays = []
    for q, k in parts:
        arrays += [pad_to(q, 2, Gp), pad_to(k, 2, S_pad)]
    if v is not None:
        v = padded_features(v, backend)
        arrays.append(pad_to(v, 2, S_pad))
    Hv = (parts[0][1] if v is None else v).shape[-1]
    kpos = (k_pos[:, None] if k_pos.ndim == 2 else k_pos)[:, :, None, :].astype(jnp.int32)  # [B,1|K,1,S]
    kpos = pad_to(kpos, 3, S_pad, -1)  # empty slots up to a whole number of blocks
    C = _splits(S_pad // block)
    L = S_pad // C
    per_head = kpos.shape[1] > 1
    in_specs = [pl.BlockSpec((None, None, 1, 1), lambda b, h, c: (b, 0, 0, 0))]
    for q, k in parts:
        in_specs += [
            pl.BlockSpec((None, None, Gp, q.shape[-1]), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((None, None, L, k.shape[-1]), lambda b, h, c: (b, h, c, 0)),
        ]
    if v is not None:
        in_specs.append(pl.BlockSpec((None, None, L, Hv), lambda b, h, c: (b, h, c, 0)))
    in_specs.append(pl.BlockSpec((None, None, 1, L), lambda b, h, c: (b, h if per_head else 0, 0, c)))
    kernel = functools.partial(
        _decode_kernel, n_parts=len(parts), shared_values=v is None, scale=scale, block=block, window=window
    )
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, C),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, Hv), lambda b, h, c: (b, h, c, 0, 0)),
            pl.BlockSpec((None, None, None, Gp, 1), lambda b, h, c: (b, h, c, 0, 0)),
            pl.BlockSpec((None, None, None, Gp, 1), lambda b, h, c: (b, h, c, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, C, Gp, Hv), jnp.float32),
            jax.ShapeDtypeStruct((B, K, C, Gp, 1), jnp.float32),
            jax.ShapeDtypeStruct((B, K, C, Gp, 1), jnp.float32),
        ],
        name="kvjax_decode_attention",
        **call_options(backend),
    )(q_pos.astype(jnp.int32).reshape(B, 1, 1, 1), *arrays, kpos)
    return o[..., :Hv_out], m, l


def decode_attention(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    scale: float,
    window: int | None = None,
    backend: str | None = None,
    block: int | None = None,
) -> jax.Array:
    """Attention of one query per row: q `[B,K,G,H]` (the G query heads of each KV head), k `[B,K,S,H]`,
    v `[B,K,S,Hv]`, q_pos `[B]`, k_pos `[B,S]` or `[B,K,S]` -> `[B,K,G,Hv]` fp32."""
    o, m, l = decode_partials(((q, k),), v, q_pos, k_pos, scale=scale, window=window, backend=backend, block=block)
    return combine(o, m, l)[:, :, : q.shape[2]]


def latent_decode_attention(
    q_latent, q_rope, c, k_rope, q_pos, k_pos, *, scale: float, backend: str | None = None, block: int | None = None
) -> jax.Array:
    """MLA's absorbed decode (DeepSeek-V2, sec. 2.1.2): logits q_latent . c + q_rope . k_rope over the
    latent cache, values the latents themselves, read once per block. q_latent `[B,N,Dc]`, q_rope
    `[B,N,Dr]`, c `[B,S,Dc]`, k_rope `[B,S,Dr]` -> `[B,N,Dc]` fp32 (one shared latent "KV head")."""
    parts = ((q_latent[:, None], c[:, None]), (q_rope[:, None], k_rope[:, None]))
    o, m, l = decode_partials(parts, None, q_pos, k_pos, scale=scale, backend=backend, block=block)
    return combine(o, m, l)[:, 0, : q_latent.shape[1]]


def decode_attention_reference(q, k, v, q_pos, k_pos, *, scale: float, window: int | None = None) -> jax.Array:
    """The same attention in plain jnp (fp32, one softmax over every slot), for tests."""
    kp = k_pos[:, None] if k_pos.ndim == 2 else k_pos  # [B,1|K,S]
    vis = visible(q_pos[:, None, None], kp, window)[:, :, None, :]  # [B,1|K,1,S]
    s = jnp.einsum("bkgh,bksh->bkgs", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    p = jnp.where(vis, jax.nn.softmax(jnp.where(vis, s, MASKED), axis=-1), 0.0)
    return jnp.einsum("bkgs,bksh->bkgh", p, v.astype(jnp.float32))

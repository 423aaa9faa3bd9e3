"""Flash attention for training and prefill (FlashAttention-2: Dao 2023, arXiv 2307.08691): softmax
attention computed block by block with an online softmax, never materialising the [T, S] logits.

Layout: the G query heads of each KV head are laid out as rows `(t, g)` of one matrix per (row, KV head)
`[T*G, H]`, so GQA reads K/V once per KV head without repeating them. A Pallas program takes `block_q`
rows and walks the keys in blocks of `block_k` slots (running max m, normaliser l and output o in fp32),
skipping key blocks no row in it can see, and writes o / l and the log-sum-exp m + log l. Masks come
from positions exactly as `kvjax.ops.visible` (causal 0 <= k_pos <= q_pos, padding position -1, sliding
window), so ragged batches, compressed caches and chunked prefill against a cache need nothing special.

Blocks: block_q = 128 rows (the next power of two >= 16 for fewer), block_k = 128 slots (likewise);
rows and slots are padded up to whole blocks with invisible entries. One program holds its head's whole
K/V (on TPU they are copied to VMEM: S * H * 4 bytes * 2 (K and V) * 2 (double buffering) must fit).

Backward (`jax.custom_vjp`): FlashAttention-2's backward written blockwise in jnp (a scan over key
blocks that recomputes each block's probabilities from the saved log-sum-exp: dV = P^T dO,
dS = P * (dO V^T - rowsum(dO * O)), dQ += dS K, dK = dS^T Q), so memory stays O(T * block_k) on every
backend. XLA fuses each block's few matmuls well; a Pallas backward would save re-reading Q and dO once
per key block and is the next step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import MASKED, block_size, call_options, pad_to, padded_features
from pallas_kernels.online_softmax import dot_t, start, visible, walk, weighted


def _flash_kernel(qpos_ref, q_ref, k_ref, v_ref, kpos_ref, o_ref, lse_ref, *, scale, block, window):
    """One (row, KV head, query block): q `[bq,H]`, positions `[bq,1]`; k `[S,H]`, v `[S,Hv]`, key
    positions `[1,S]`; out o `[bq,Hv]` and the log-sum-exp `[bq,1]`."""
    q = q_ref[...].astype(jnp.float32) * scale
    q_pos = qpos_ref[...]

    o, m, l = walk(k_ref.shape[0] // block, block, q_pos, kpos_ref, window,
                   lambda keys: dot_t(q, k_ref[keys, :]), weighted(v_ref), start(*o_ref.shape))
    seen = l > 0
    o_ref[...] = jnp.where(seen, o / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _rows(q, q_pos):
    """q `[B,T,K,G,H]` -> rows `[B,K,T*G,H]` and their positions `[B,1,T*G,1]`."""
    B, T, K, G, H = q.shape
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    return rows, jnp.repeat(q_pos.astype(jnp.int32), G, axis=1).reshape(B, 1, T * G, 1)


def _forward(rows, row_pos, k, v, k_pos, *, scale, window, backend):
    """o `[B,K,R,Hv]` (fp32) and lse `[B,K,R]` of rows `[B,K,R,H]` over k `[B,K,S,H]`, v `[B,K,S,Hv]`."""
    Hv_out = v.shape[-1]
    rows, k, v = (padded_features(x, backend) for x in (rows, k, v))
    B, K, R, H = rows.shape
    S, Hv = k.shape[2], v.shape[-1]
    bq, bk = block_size(R), block_size(S)
    R_pad, S_pad = -(-R // bq) * bq, -(-S // bk) * bk
    rows, row_pos = pad_to(rows, 2, R_pad), pad_to(row_pos, 2, R_pad, -1)
    k, v = pad_to(k, 2, S_pad), pad_to(v, 2, S_pad)
    kpos = pad_to((k_pos[:, None] if k_pos.ndim == 2 else k_pos)[:, :, None, :].astype(jnp.int32), 3, S_pad, -1)
    per_head = kpos.shape[1] > 1
    o, lse = pl.pallas_call(
        functools.partial(_flash_kernel, scale=scale, block=bk, window=window),
        grid=(B, K, R_pad // bq),
        in_specs=[
            pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, 0, i, 0)),
            pl.BlockSpec((None, None, bq, H), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, S_pad, H), lambda b, h, i: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S_pad, Hv), lambda b, h, i: (b, h, 0, 0)),
            pl.BlockSpec((None, None, 1, S_pad), lambda b, h, i: (b, h if per_head else 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, Hv), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, R_pad, Hv), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, R_pad, 1), jnp.float32)],
        name="kvjax_flash_attention",
        **call_options(backend),
    )(row_pos, rows, k, v, kpos)
    return o[:, :, :R, :Hv_out], lse[:, :, :R, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention_rows(rows, row_pos, k, v, k_pos, scale, window, backend):
    return _forward(rows, row_pos, k, v, k_pos, scale=scale, window=window, backend=backend)[0]


def _attention_rows_fwd(rows, row_pos, k, v, k_pos, scale, window, backend):
    o, lse = _forward(rows, row_pos, k, v, k_pos, scale=scale, window=window, backend=backend)
    return o, (rows, row_pos, k, v, k_pos, o, lse)


def _attention_rows_bwd(scale, window, backend, residuals, d_o):
    """FlashAttention-2's backward, one key block at a time (see the module docstring)."""
    rows, row_pos, k, v, k_pos, o, lse = residuals
    B, K, R, H = rows.shape
    S, Hv = k.shape[2], v.shape[-1]
    bk = block_size(S)
    S_pad = -(-S // bk) * bk
    C = S_pad // bk
    q = rows.astype(jnp.float32)
    d_o = d_o.astype(jnp.float32)
    delta = (d_o * o).sum(axis=-1)  # rowsum(dO * O) [B,K,R]
    kp = pad_to(k_pos[:, None] if k_pos.ndim == 2 else k_pos, 2, S_pad, -1)  # [B,1|K,S_pad]

    def blocks(x, width):  # [B,K,S,X] -> [C,B,K,bk,X]
        return pad_to(x, 2, S_pad).astype(jnp.float32).reshape(B, K, C, bk, width).transpose(2, 0, 1, 3, 4)

    xs = (blocks(k, H), blocks(v, Hv), kp.reshape(B, kp.shape[1], C, bk).transpose(2, 0, 1, 3))

    def step(dq, block):
        kb, vb, pb = block
        vis = visible(row_pos[..., 0][..., None], pb[:, :, None, :], window)  # [B,1|K,R,bk]
        s = jnp.einsum("bkrh,bksh->bkrs", q, kb) * scale
        p = jnp.where(vis, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum("bkrs,bkrh->bksh", p, d_o)
        ds = p * (jnp.einsum("bkrh,bksh->bkrs", d_o, vb) - delta[..., None])
        dk = jnp.einsum("bkrs,bkrh->bksh", ds, q) * scale
        return dq + jnp.einsum("bkrs,bksh->bkrh", ds, kb) * scale, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(q), xs)
    unblock = lambda x: x.transpose(1, 2, 0, 3, 4).reshape(B, K, S_pad, -1)[:, :, :S]  # noqa: E731
    return (dq.astype(rows.dtype), None, unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None)


_attention_rows.defvjp(_attention_rows_fwd, _attention_rows_bwd)


def flash_attention(q, k, v, q_pos, k_pos, *, scale: float, window: int | None = None,
                    backend: str | None = None) -> jax.Array:
    """softmax(q k^T * scale, masked by positions) v for q `[B,T,N,H]`, k `[B,K,S,H]`, v `[B,K,S,Hv]`,
    q_pos `[B,T]`, k_pos `[B,S]` or `[B,K,S]` -> `[B,T,N,Hv]` fp32; differentiable in q, k and v."""
    B, T, N, H = q.shape
    K = k.shape[1]
    rows, row_pos = _rows(q.reshape(B, T, K, N // K, H), q_pos)
    o = _attention_rows(rows, row_pos, k, v, k_pos, scale, window, backend)  # [B,K,T*G,Hv]
    return o.reshape(B, K, T, N // K, -1).transpose(0, 2, 1, 3, 4).reshape(B, T, N, -1)


def flash_attention_reference(q, k, v, q_pos, k_pos, *, scale: float, window: int | None = None) -> jax.Array:
    """The same attention in plain jnp (fp32, the full [T,S] softmax), for tests."""
    B, T, N, H = q.shape
    K = k.shape[1]
    kp = k_pos[:, None] if k_pos.ndim == 2 else k_pos  # [B,1|K,S]
    vis = visible(q_pos[:, None, :, None], kp[:, :, None, :], window)[:, :, :, None, :]  # [B,1|K,T,1,S]
    s = jnp.einsum("btkgh,bksh->bktgs", q.reshape(B, T, K, N // K, H).astype(jnp.float32), k.astype(jnp.float32))
    p = jnp.where(vis, jax.nn.softmax(jnp.where(vis, s * scale, MASKED), axis=-1), 0.0)
    out = jnp.einsum("bktgs,bksh->btkgh", p, v.astype(jnp.float32))
    return out.reshape(B, T, N, -1)

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

Backward (`jax.custom_vjp`), FlashAttention-2's (alg. 2) as two Pallas kernels that recompute each
block's probabilities from the saved log-sum-exp, P = exp(Q K^T scale - lse), with D = rowsum(dO * O):
one program per key block walks the query blocks for dV = P^T dO and dK = scale (P * (dO V^T - D))^T Q;
one per query block walks the key blocks for dQ = scale (P * (dO V^T - D)) K. Two kernels rather than
one with atomic adds into dQ (FlashAttention-2's choice on GPU), so that every output block has one
writer on every backend. Blocks that no pair can see are skipped in both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.backend import MASKED, block_size, call_options, pad_to, padded_features
from kvjax.pallas_kernels.online_softmax import any_visible, dot_t, start, visible, walk, weighted


def _flash_kernel(qpos_ref, q_ref, k_ref, v_ref, kpos_ref, o_ref, lse_ref, *, scale, block, window):
    """One (row, KV head, query block): q `[bq,H]`, positions `[bq,1]`; k `[S,H]`, v `[S,Hv]`, key
    positions `[1,S]`; out o `[bq,Hv]` and the log-sum-exp `[bq,1]`."""
    q = q_ref[...].astype(jnp.float32) * scale
    q_pos = qpos_ref[...]

    o, m, l = walk(
        k_ref.shape[0] // block,
        block,
        q_pos,
        kpos_ref,
        window,
        lambda keys: dot_t(q, k_ref[keys, :]),
        weighted(v_ref),
        start(*o_ref.shape),
    )
    seen = l > 0
    o_ref[...] = jnp.where(seen, o / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _rows(q, q_pos):
    """q `[B,T,K,G,H]` -> rows `[B,K,T*G,H]` and their positions `[B,1,T*G,1]`."""
    B, T, K, G, H = q.shape
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    return rows, jnp.repeat(q_pos.astype(jnp.int32), G, axis=1).reshape(B, 1, T * G, 1)


def _operands(rows, row_pos, k, v, k_pos, backend):
    """The operands padded for the kernels: feature dims for Triton, rows and slots to whole blocks
    (invisible entries). Returns them with the block sizes (bq, bk)."""
    rows, k, v = (padded_features(x, backend) for x in (rows, k, v))
    R, S = rows.shape[2], k.shape[2]
    bq, bk = block_size(R), block_size(S)
    R_pad, S_pad = -(-R // bq) * bq, -(-S // bk) * bk
    kpos = (k_pos[:, None] if k_pos.ndim == 2 else k_pos)[:, :, None, :].astype(jnp.int32)
    return (
        pad_to(rows, 2, R_pad),
        pad_to(row_pos, 2, R_pad, -1),
        pad_to(k, 2, S_pad),
        pad_to(v, 2, S_pad),
        pad_to(kpos, 3, S_pad, -1),
        (bq, bk),
    )


def _specs(R: int, S: int, row_widths, key_widths, per_head: bool, rows_block: int | None, keys_block: int | None):
    """in_specs over the grid (row, KV head, i) for: the row positions `[R,1]`, row arrays `[R, width]`,
    key arrays `[S, width]`, the key positions `[1,S]`. Rows come in blocks of `rows_block` (block i),
    or all of them when None; keys likewise with `keys_block`."""

    def spec(n, block, width):
        if block is None:
            return pl.BlockSpec((None, None, n, width), lambda b, h, i: (b, h, 0, 0))
        return pl.BlockSpec((None, None, block, width), lambda b, h, i: (b, h, i, 0))

    heads = (lambda h: h) if per_head else (lambda h: 0)
    row_pos = pl.BlockSpec((None, None, rows_block or R, 1), lambda b, h, i: (b, 0, 0 if rows_block is None else i, 0))
    key_pos = pl.BlockSpec(
        (None, None, 1, keys_block or S), lambda b, h, i: (b, heads(h), 0, 0 if keys_block is None else i)
    )
    return [
        row_pos,
        *(spec(R, rows_block, w) for w in row_widths),
        *(spec(S, keys_block, w) for w in key_widths),
        key_pos,
    ]


def _forward(rows, row_pos, k, v, k_pos, *, scale, window, backend):
    """o `[B,K,R,Hv]` (fp32) and lse `[B,K,R]` of rows `[B,K,R,H]` over k `[B,K,S,H]`, v `[B,K,S,Hv]`."""
    R, Hv_out = rows.shape[2], v.shape[-1]
    rows, row_pos, k, v, kpos, (bq, bk) = _operands(rows, row_pos, k, v, k_pos, backend)
    B, K, R_pad, H = rows.shape
    S_pad, Hv = k.shape[2], v.shape[-1]
    o, lse = pl.pallas_call(
        functools.partial(_flash_kernel, scale=scale, block=bk, window=window),
        grid=(B, K, R_pad // bq),
        in_specs=_specs(R_pad, S_pad, [H], [H, Hv], kpos.shape[1] > 1, bq, None),
        out_specs=[
            pl.BlockSpec((None, None, bq, Hv), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, R_pad, Hv), jnp.float32),
            jax.ShapeDtypeStruct((B, K, R_pad, 1), jnp.float32),
        ],
        name="kvjax_flash_attention",
        **call_options(backend),
    )(row_pos, rows, k, v, kpos)
    return o[:, :, :R, :Hv_out], lse[:, :, :R, 0]


def _probs_and_ds(q, d_o, lse, delta, k, v, vis, scale):
    """A block's recomputed probabilities P `[bq,bk]` and dS = P * (dO V^T - D) (FlashAttention-2, alg. 2)."""
    p = jnp.where(vis, jnp.exp(dot_t(q, k) * scale - lse), 0.0)
    return p, p * (dot_t(d_o, v) - delta)


def _dkdv_kernel(
    qpos_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kpos_ref, dk_ref, dv_ref, *, scale, block, window
):
    """One (row, KV head, key block): every row's q `[R,H]`, dO `[R,Hv]`, lse, D and position `[R,1]`; the
    block's k `[bk,H]`, v `[bk,Hv]` and key positions `[1,bk]`; out dk `[bk,H]`, dv `[bk,Hv]`."""
    k, v, k_pos = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32), kpos_ref[...]

    def step(i, carry):
        rows = pl.ds(pl.multiple_of(i * block, block), block)
        vis = visible(qpos_ref[rows, :], k_pos, window)

        def fold(carry):
            dk, dv = carry
            q, d_o = q_ref[rows, :].astype(jnp.float32), do_ref[rows, :].astype(jnp.float32)
            p, ds = _probs_and_ds(q, d_o, lse_ref[rows, :], delta_ref[rows, :], k, v, vis, scale)
            return (
                dk + jnp.dot(ds.T, q, preferred_element_type=jnp.float32) * scale,
                dv + jnp.dot(p.T, d_o, preferred_element_type=jnp.float32),
            )

        return jax.lax.cond(any_visible(vis), fold, lambda c: c, carry)

    dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // block, step, (jnp.zeros_like(k), jnp.zeros_like(v)))
    dk_ref[...], dv_ref[...] = dk, dv


def _dq_kernel(qpos_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kpos_ref, dq_ref, *, scale, block, window):
    """One (row, KV head, query block): the block's q `[bq,H]`, dO `[bq,Hv]`, lse, D and positions `[bq,1]`;
    every key's k `[S,H]`, v `[S,Hv]` and position `[1,S]`; out dq `[bq,H]`."""
    q, d_o, lse, delta = (r[...].astype(jnp.float32) for r in (q_ref, do_ref, lse_ref, delta_ref))

    def step(j, dq):
        keys = pl.ds(pl.multiple_of(j * block, block), block)
        vis = visible(qpos_ref[...], kpos_ref[:, keys], window)

        def fold(dq):
            k = k_ref[keys, :].astype(jnp.float32)
            _, ds = _probs_and_ds(q, d_o, lse, delta, k, v_ref[keys, :].astype(jnp.float32), vis, scale)
            return dq + jnp.dot(ds, k, preferred_element_type=jnp.float32) * scale

        return jax.lax.cond(any_visible(vis), fold, lambda c: c, dq)

    dq_ref[...] = jax.lax.fori_loop(0, k_ref.shape[0] // block, step, jnp.zeros_like(q))


def _backward(rows, row_pos, k, v, k_pos, o, lse, d_o, *, scale, window, backend):
    """(dq, dk, dv) of the rows' attention, from the forward's o and lse and the output gradient d_o."""
    (R, H), (S, Hv) = rows.shape[2:], v.shape[2:]
    delta = (d_o.astype(jnp.float32) * o).sum(axis=-1, keepdims=True)  # D = rowsum(dO * O) [B,K,R,1]
    rows, row_pos, k, v, kpos, (bq, bk) = _operands(rows, row_pos, k, v, k_pos, backend)
    B, K, R_pad, Hp = rows.shape
    S_pad, Hvp = k.shape[2], v.shape[-1]
    d_o = pad_to(padded_features(d_o, backend), 2, R_pad)
    lse, delta = pad_to(lse[..., None], 2, R_pad), pad_to(delta, 2, R_pad)
    operands = (row_pos, rows, d_o, lse, delta, k, v, kpos)

    def call(kernel, rows_block, keys_block, n, outputs):
        return pl.pallas_call(
            functools.partial(kernel, scale=scale, block=bq if rows_block is None else bk, window=window),
            grid=(B, K, n),
            in_specs=_specs(R_pad, S_pad, [Hp, Hvp, 1, 1], [Hp, Hvp], kpos.shape[1] > 1, rows_block, keys_block),
            out_specs=[pl.BlockSpec((None, None, blk, w), lambda b, h, i: (b, h, i, 0)) for blk, w, _ in outputs],
            out_shape=[jax.ShapeDtypeStruct((B, K, total, w), jnp.float32) for _, w, total in outputs],
            name=f"kvjax_flash_attention_{kernel.__name__.strip('_').removesuffix('_kernel')}",
            **call_options(backend),
        )(*operands)

    dk, dv = call(_dkdv_kernel, None, bk, S_pad // bk, [(bk, Hp, S_pad), (bk, Hvp, S_pad)])
    (dq,) = call(_dq_kernel, bq, None, R_pad // bq, [(bq, Hp, R_pad)])
    return dq[:, :, :R, :H], dk[:, :, :S, :H], dv[:, :, :S, :Hv]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention_rows(rows, row_pos, k, v, k_pos, scale, window, backend):
    return _forward(rows, row_pos, k, v, k_pos, scale=scale, window=window, backend=backend)[0]


def _attention_rows_fwd(rows, row_pos, k, v, k_pos, scale, window, backend):
    o, lse = _forward(rows, row_pos, k, v, k_pos, scale=scale, window=window, backend=backend)
    return o, (rows, row_pos, k, v, k_pos, o, lse)


def _attention_rows_bwd(scale, window, backend, residuals, d_o):
    rows, row_pos, k, v, k_pos, o, lse = residuals
    dq, dk, dv = _backward(rows, row_pos, k, v, k_pos, o, lse, d_o, scale=scale, window=window, backend=backend)
    return dq.astype(rows.dtype), None, dk.astype(k.dtype), dv.astype(v.dtype), None


_attention_rows.defvjp(_attention_rows_fwd, _attention_rows_bwd)


def flash_attention(
    q, k, v, q_pos, k_pos, *, scale: float, window: int | None = None, backend: str | None = None
) -> jax.Array:
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

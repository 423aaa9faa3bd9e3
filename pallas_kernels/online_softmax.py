"""What every attention kernel here shares: the mask from positions and FlashAttention-2's online softmax
(Dao 2023, alg. 1): a running max m, normaliser l and unnormalised output o per query row, in fp32,
updated one key block at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.backend import MASKED


def visible(q_pos, k_pos, window: int | None):
    """As `kvjax.ops.visible`: 0 <= k_pos <= q_pos, and q_pos - k_pos < window with a window."""
    vis = (k_pos >= 0) & (k_pos <= q_pos)
    return vis if window is None else vis & (q_pos - k_pos < window)


def start(rows: int, width: int):
    """(o, m, l) before any key: zeros, MASKED (finite, so an all-masked row never makes NaN), zeros."""
    return (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows, 1), MASKED, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )


def update(carry, logits, vis, weigh):
    """Fold one key block in: fp32 logits `[rows, block]`, its mask, and `weigh(p)`, the block's values
    weighted by probabilities p `[rows, block]` (shaped as o: an array or a tuple of them)."""
    o, m, l = carry
    s = jnp.where(vis, logits, MASKED)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
    rescale = jnp.exp(m - m_new)
    o = jax.tree.map(lambda acc, new: rescale * acc + new, o, weigh(p))
    return o, m_new, rescale * l + p.sum(axis=1, keepdims=True)


def walk(n_blocks: int, block: int, q_pos, kpos_ref, window, logits, weigh, carry):
    """Fold key blocks 0..n_blocks-1 into (o, m, l), skipping blocks that no row can see: for a block's
    slots `keys` (a pl.ds), `logits(keys)` gives its fp32 logits and `weigh(keys, p)` its values
    weighted by the probabilities p (`weighted(v_ref)` for values stored as they are)."""

    def step(i, carry):
        keys = pl.ds(pl.multiple_of(i * block, block), block)
        vis = visible(q_pos, kpos_ref[:, keys], window)
        fold = lambda c: update(c, logits(keys), vis, lambda p: weigh(keys, p))  # noqa: E731
        return jax.lax.cond(any_visible(vis), fold, lambda c: c, carry)

    return jax.lax.fori_loop(0, n_blocks, step, carry)


def weighted(v_ref):
    """`weigh` for values stored as they are, `[slots, width]`: p . v_block in fp32."""
    return lambda keys, p: jnp.dot(p, v_ref[keys, :].astype(jnp.float32), preferred_element_type=jnp.float32)


def dot_t(a, b):
    """a `[m, d]` . b `[n, d]`^T in fp32 (the q.k of a block)."""
    return jax.lax.dot_general(a, b.astype(jnp.float32), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def any_visible(vis):
    """Whether a block has a visible key (max, not any: Triton has no reduce_or)."""
    return jnp.max(vis.astype(jnp.int32)) > 0

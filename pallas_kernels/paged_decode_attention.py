"""Paged decode attention (PagedAttention, Kwon et al. 2023, sec. 4.1): one query per row over K/V held
in a shared pool of pages, read through each row's block table, never gathered into a dense copy.

The pools are `[P,K,page_size,H]` (head-major pages, `kvjax.paged.PagedKVCache`), a position per pool slot
`[P,page_size]` (or per head and slot, `[P,K,page_size]`), and per row a block table `[B,M]` of page ids and
a length: slot j of row b is page `table[b, j // page_size]`, offset `j % page_size`, and holds a token of
the row when j < length[b] and its position is visible from the query's (as in `kvjax.ops.visible`). The
query heads of one KV head go through together (GQA), and the online softmax of FlashAttention-2 folds in
one page at a time.
Two designs, one per compiler, the same arithmetic:

- `gather` (Triton, and interpret mode): a program per (row, KV head, split of the table's columns),
  as flash-decoding splits keys; it walks its pages reading each page's id from the table and the page
  from the pool (the pool stays in global memory; only the page is loaded), skipping pages at or past
  the row's length. Splits are merged by `decode_attention.combine`.
- `grid` (TPU, Mosaic; also runs in interpret mode): the table and lengths are scalar-prefetched and
  the grid's last axis walks the row's pages, so each page is DMA'd straight from the pool by its
  block index (the pages past the length repeat the last one: no new copy), the (o, m, l) carry
  accumulating in the resident output block. Mosaic GPU has no scalar prefetch, hence two designs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu  # the scalar-prefetch grid spec (interpret mode runs it anywhere)

from kvjax.pallas_kernels.backend import call_options, pad_to, padded_features, padded_group, resolve
from kvjax.pallas_kernels.decode_attention import MAX_SPLITS, combine, decode_attention_reference
from kvjax.pallas_kernels.online_softmax import any_visible, dot_t, start, update, visible

DESIGNS = ("gather", "grid")


def _fold_page(carry, q, k, v, kpos, first_slot, length, q_pos, window):
    """Fold one page (keys k `[ps,H]`, values v `[ps,Hv]`, positions `[1,ps]`, its first slot's index in
    the row) into the online-softmax carry; slots at or past the row's length hold no token of it."""
    ps = k.shape[0]
    mine = first_slot + jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1) < length
    vis = mine & visible(q_pos, kpos, window)
    weigh = lambda p: jnp.dot(p, v.astype(jnp.float32), preferred_element_type=jnp.float32)  # noqa: E731
    return jax.lax.cond(any_visible(vis), lambda c: update(c, dot_t(q, k), vis, weigh), lambda c: c, carry)


def _gather_kernel(meta_ref, table_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, m_ref, l_ref, *, scale, window):
    """One (row, KV head, split): meta `[1,2]` (query position, row length), the split's table columns
    `[1,Mc]`, the query group `[Gp,H]`, the head's whole pools `[P,ps,H]` and its positions `[P,1,ps]`."""
    q = q_ref[...].astype(jnp.float32) * scale
    q_pos, length = meta_ref[0, 0], meta_ref[0, 1]
    ps, n_cols = k_ref.shape[1], table_ref.shape[1]
    first_col = pl.program_id(2) * n_cols

    def page(i, carry):
        first_slot = (first_col + i) * ps
        p = table_ref[0, i]
        fold = lambda c: _fold_page(c, q, k_ref[p], v_ref[p], pos_ref[p], first_slot, length, q_pos, window)  # noqa: E731
        return jax.lax.cond(first_slot < length, fold, lambda c: c, carry)

    o, m, l = jax.lax.fori_loop(0, n_cols, page, start(*o_ref.shape))
    o_ref[...], m_ref[...], l_ref[...] = o, m, l


def _grid_kernel(table_ref, length_ref, qpos_ref, q_ref, k_ref, v_ref, pos_ref, o_ref, m_ref, l_ref, *, scale, window):
    """One (row, KV head, page): the carry lives in the output blocks, resident across the page axis."""
    b, col = pl.program_id(0), pl.program_id(2)
    ps, length = k_ref.shape[0], length_ref[b]

    @pl.when(col == 0)
    def _():
        o_ref[...], m_ref[...], l_ref[...] = start(*o_ref.shape)

    @pl.when(col * ps < length)
    def _():
        q = q_ref[...].astype(jnp.float32) * scale
        carry = (o_ref[...], m_ref[...], l_ref[...])
        o_ref[...], m_ref[...], l_ref[...] = _fold_page(
            carry, q, k_ref[...], v_ref[...], pos_ref[...], col * ps, length, qpos_ref[b], window
        )


def _gather_call(q, k_pages, v_pages, pos_pages, table, length, q_pos, *, scale, window, backend):
    (B, K, Gp, H), Hv, M = q.shape, v_pages.shape[-1], table.shape[1]
    P, _, ps, _ = k_pages.shape
    per_head = pos_pages.shape[1] > 1
    C = max(1, min(MAX_SPLITS, M // 8))  # about 8 pages (128 slots at 16 a page) or more per split
    Mc = 1 << (-(-M // C) - 1).bit_length()  # a power of two of table columns per split (Triton's blocks)
    C = -(-M // Mc)
    table = pad_to(table, 1, C * Mc)  # null pages past every row's length: never read
    meta = jnp.stack([q_pos, length], axis=-1).astype(jnp.int32)[:, None]  # [B,1,2]
    kernel = functools.partial(_gather_kernel, scale=scale, window=window)
    return pl.pallas_call(
        kernel,
        grid=(B, K, C),
        in_specs=[
            pl.BlockSpec((None, 1, 2), lambda b, h, c: (b, 0, 0)),
            pl.BlockSpec((None, 1, Mc), lambda b, h, c: (b, 0, c)),
            pl.BlockSpec((None, None, Gp, H), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((P, None, ps, H), lambda b, h, c: (0, h, 0, 0)),
            pl.BlockSpec((P, None, ps, Hv), lambda b, h, c: (0, h, 0, 0)),
            pl.BlockSpec((P, None, 1, ps), lambda b, h, c: (0, h if per_head else 0, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, None, Gp, w), lambda b, h, c: (b, h, c, 0, 0)) for w in (Hv, 1, 1)],
        out_shape=[jax.ShapeDtypeStruct((B, K, C, Gp, w), jnp.float32) for w in (Hv, 1, 1)],
        name="kvjax_paged_decode_attention",
        **call_options(backend),
    )(meta, table[:, None].astype(jnp.int32), q, k_pages, v_pages, pos_pages[:, :, None])


def _grid_call(q, k_pages, v_pages, pos_pages, table, length, q_pos, *, scale, window, backend):
    (B, K, Gp, H), Hv, M = q.shape, v_pages.shape[-1], table.shape[1]
    ps, per_head = k_pages.shape[2], pos_pages.shape[1] > 1

    def page(b, h, col, table, length, q_pos):  # past the length, the row's last page again: no new DMA
        last = jnp.maximum(jax.lax.div(length[b] + ps - 1, ps) - 1, 0)  # lax.div: Mosaic lowers no floor division
        return table[b, jnp.minimum(col, last)]

    options = call_options(backend)
    if resolve(backend) == "tpu":  # the page axis carries the softmax state: it runs in order
        options["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, K, M),
        in_specs=[
            pl.BlockSpec((None, None, Gp, H), lambda b, h, c, *_: (b, h, 0, 0)),
            pl.BlockSpec((None, None, ps, H), lambda b, h, c, *s: (page(b, h, c, *s), h, 0, 0)),
            pl.BlockSpec((None, None, ps, Hv), lambda b, h, c, *s: (page(b, h, c, *s), h, 0, 0)),
            pl.BlockSpec((None, None, 1, ps), lambda b, h, c, *s: (page(b, h, c, *s), h if per_head else 0, 0, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, None, Gp, w), lambda b, h, c, *_: (b, h, 0, 0, 0)) for w in (Hv, 1, 1)],
    )
    kernel = functools.partial(_grid_kernel, scale=scale, window=window)
    return pl.pallas_call(
        kernel,
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, 1, Gp, w), jnp.float32) for w in (Hv, 1, 1)],
        name="kvjax_paged_decode_attention",
        **options,
    )(
        table.astype(jnp.int32),
        length.astype(jnp.int32),
        q_pos.astype(jnp.int32),
        q,
        k_pages,
        v_pages,
        pos_pages[:, :, None],
    )


def paged_decode_partials(
    q,
    k_pages,
    v_pages,
    pos_pages,
    table,
    length,
    q_pos,
    *,
    scale: float,
    window: int | None = None,
    backend: str | None = None,
    design: str | None = None,
):
    """Split partials (o `[B,K,C,Gp,Hv]`, m and l `[B,K,C,Gp,1]`, fp32; merge with `combine`) of one query
    per row q `[B,K,G,H]` over pages k_pages `[P,K,ps,H]`, v_pages `[P,K,ps,Hv]`, positions pos_pages
    `[P,ps]` or per head `[P,K,ps]`, through table `[B,M]` and length `[B]`; q_pos `[B]`. `design` defaults
    to `grid` on TPU and `gather` elsewhere (see the module docstring)."""
    design = design or ("grid" if resolve(backend) == "tpu" else "gather")
    if design not in DESIGNS:
        raise ValueError(f"paged decode design={design!r} must be one of {DESIGNS}")
    P, K, ps, H = k_pages.shape
    pos_pages = pos_pages[:, None] if pos_pages.ndim == 2 else pos_pages
    if (
        q.ndim != 4
        or q.shape[1] != K
        or q.shape[3] != H
        or v_pages.shape[:3] != (P, K, ps)
        or pos_pages.shape not in ((P, 1, ps), (P, K, ps))
    ):
        raise ValueError(
            f"q {q.shape} must be [B,K={K},G,H={H}] and v_pages {v_pages.shape} / pos_pages "
            f"{pos_pages.shape} match k_pages {k_pages.shape} ([P,K,page_size,H] / [P,(K,)page_size])"
        )
    if resolve(backend) == "triton" and design == "grid":
        raise ValueError("paged decode design='grid' needs scalar prefetch (TPU's); Triton takes design='gather'")
    if resolve(backend) == "triton" and (ps < 16 or ps & (ps - 1)):
        raise ValueError(f"page_size={ps}: the Triton paged kernel needs a power of two >= 16 (its dot operands)")
    G = q.shape[2]
    q = padded_features(pad_to(q, 2, padded_group(G)), backend)
    k_pages, v_pages = padded_features(k_pages, backend), padded_features(v_pages, backend)
    call = _grid_call if design == "grid" else _gather_call
    return call(q, k_pages, v_pages, pos_pages, table, length, q_pos, scale=scale, window=window, backend=backend)


def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    pos_pages,
    table,
    length,
    q_pos,
    *,
    scale: float,
    window: int | None = None,
    backend: str | None = None,
    design: str | None = None,
) -> jax.Array:
    """Attention `[B,K,G,Hv]` fp32 of one query per row over its pages (arguments as `paged_decode_partials`)."""
    Hv = v_pages.shape[-1]
    o, m, l = paged_decode_partials(
        q, k_pages, v_pages, pos_pages, table, length, q_pos, scale=scale, window=window, backend=backend, design=design
    )
    return combine(o, m, l)[:, :, : q.shape[2], :Hv]


def paged_decode_reference(
    q, k_pages, v_pages, pos_pages, table, length, q_pos, *, scale: float, window: int | None = None
) -> jax.Array:
    """The same attention over the rows' pages gathered into dense `[B,K,M*ps,H]` K/V, in plain jnp."""
    B, M = table.shape
    _, K, ps, _ = k_pages.shape
    dense = lambda pool: pool[table].transpose(0, 2, 1, 3, 4).reshape(B, pool.shape[1], M * ps, -1)  # noqa: E731
    pos_pages = pos_pages[:, None] if pos_pages.ndim == 2 else pos_pages
    mine = jnp.arange(M * ps)[None, None] < length[:, None, None]
    k_pos = jnp.where(mine, dense(pos_pages[..., None])[..., 0], -1)  # [B,1|K,M*ps]
    return decode_attention_reference(q, dense(k_pages), dense(v_pages), q_pos, k_pos, scale=scale, window=window)

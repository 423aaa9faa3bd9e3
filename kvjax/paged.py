"""Paged KV memory on the device (PagedAttention, Kwon et al. 2023, sec. 4): K/V live in a pool of
fixed-size pages shared by every sequence, each sequence holding a block table of page ids; the host
side (`kvjax.page_pool.PagePool`: which pages each sequence holds) is apart, as vLLM splits its block
manager from its model runner.

- `PagedKVCache` is one K/V-producing layer's pages: pools `[n_pages, K, page_size, H]` (head-major, as
  the other caches), a position per pool slot, and per sequence slot its block table and length.
  `update` writes a chunk at slots computed from the table and returns the gathered view, so
  attention, masks and the decoder need nothing new (the XLA reference path; the pages are gathered).
  The view also carries the cache itself (`KVView.paged`): under `impl=pallas` a decode step reads the
  pages through the block tables in `pallas_kernels.paged_decode_attention` and XLA drops the gather.
  `PagedLatentCache` holds MLA's latents and RoPE keys in pages the same way (gathered for attention).
- A *mixed step* (`chunk_row` set; Sarathi-Serve's stall-free batches, Agrawal et al. 2024, as vLLM V1
  schedules one token budget): the chunk `[1, R + C]` is one decode token for each of the R sequence
  slots, then C prompt tokens of slot `chunk_row`, so a prefill chunk and every decode row share one
  pass through the weights. Each part attends to its own rows' pages (`RowSplit`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, KVView, LatentCache, LatentView, WindowKVCache, _Arrays
from kvjax.ops import attention, capped, kernel_impl, masked_probs, visible
from kvjax.page_pool import NULL_PAGE
from kvjax.quant.packing import pack, packed_width, unpack
from kvjax.quant.quantizers import dequantize, quantize


def pool_is_cheaper(rows: int, columns: int, pages: int, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether R = `rows` decode queries of N = `n_heads` heads attend faster over the whole pool of P = `pages`
    pages (`PagedKVCache.attend_pool`) than over their M = `columns` table columns gathered (`view`), under
    XLA. Only where the tables span the pool (R M >= P) can it be: the gather then copies more than the pool
    holds, but the pool scores every row against every page. The costs, per page slot (K, V: 2 K H values
    copied or read; N logits a row), fitted on XLA:CPU over 70 shapes by `scripts/bench_pool_switch.py`:

        gathered  R M (K H / 2 + N (3 + H / 8))        pool  P K H / 2 + R P N (1 + H / 32)

    A gathered logit costs more than a pooled one: the pool's products take every row's queries as one matrix."""
    K, H, N = n_kv_heads, head_dim, n_heads
    pool = pages * K * H / 2 + rows * pages * N * (1 + H / 32)
    return rows * columns >= pages and pool < rows * columns * (K * H / 2 + N * (3 + H / 8))


class RowSplit(NamedTuple):
    """What a mixed step's tokens attend to: the first R tokens (one per sequence slot, decode queries)
    the view of every slot's pages `rows`, the chunk after them the view of its own slot's pages `chunk`.
    As a `KVView.reader` it runs the attention op on each part; MLA maps its own attention over both.
    With `pool` (the decode rows' cache), XLA attends the decode queries over the whole pool instead of
    the gathered rows (`PagedKVCache.attend_pool`) where that costs less (`pool_is_cheaper`). `heads`: the
    KV heads of a pooled view's entries (`kvjax.paged_pooled`), which the op masks by. `select(q, view,
    q_pos)`: the part of the rows' view that their decode queries read (Quest's pages, `kvjax.paged_quest`),
    applied by `chosen`."""

    rows: KVView | LatentView  # batch R
    chunk: KVView | LatentView  # batch 1
    pool: PagedKVCache | None = None
    heads: int | None = None
    select: Callable | None = None

    def map(self, fn, queries: tuple[jax.Array, ...], positions: jax.Array, rows_fn=None) -> jax.Array:
        """fn(*queries, view, positions) on each part of the step's queries `[1, R + C, ...]` (the decode
        part as R rows of one query, through `rows_fn` if given), joined back into `[1, R + C, ...]`."""
        R = self.rows.pos.shape[0]
        out = (rows_fn or fn)(*(q[0, :R, None] for q in queries), self.rows, positions[0, :R, None])
        out = [out.reshape(1, R, *out.shape[2:])]
        if positions.shape[1] > R:
            out.append(fn(*(q[:, R:] for q in queries), self.chunk, positions[:, R:]))
        return jnp.concatenate(out, axis=1)

    def attend(self, q: jax.Array, q_pos: jax.Array, impl: str, window: int | None, softcap=None) -> jax.Array:
        """`KVView.reader`: kvjax.ops.attention over each part (the paged kernel reads the decode rows'
        pages under Pallas)."""

        def op(q, view, pos):
            args = dict(window=window, impl=impl, paged=view.paged, softcap=softcap)
            pooled = dict(k_head=view.head, n_kv_heads=self.heads) if self.heads else {}
            return attention(q, view.k, view.v, pos, view.pos, **args, **pooled)

        def over_pool(q, view, pos):
            return self.pool.attend_pool(q, pos, window, softcap=softcap)

        xla_pool = self.pool is not None and kernel_impl(impl, softcap=softcap) == "xla" and self._pool_pays(q)
        return self.map(op, (q,), q_pos, rows_fn=over_pool if xla_pool else None)

    def _pool_pays(self, q: jax.Array) -> bool:
        """Whether the decode rows' queries (of q `[1, R + C, N, H]`) attend faster over the pool than gathered."""
        (R, M), (P, K) = self.pool.table.shape, self.pool.k.shape[:2]
        return pool_is_cheaper(R, M, P, q.shape[2], K, q.shape[3])

    def chosen(self, q: jax.Array, q_pos: jax.Array) -> RowSplit:
        """The split with the rows' view as the decode queries of a mixed step's q `[1, R + C, N, H]` at q_pos
        `[1, R + C]` read it (`select`), as a dense Quest cache hands its producer's selection to the layers
        that share its K/V."""
        R = self.rows.pos.shape[0]
        return self._replace(rows=self.select(q[0, :R, None], self.rows, q_pos[0, :R, None]), select=None)


@struct.dataclass
class PagedKVCache(_Arrays):
    """One layer's pages: k, v `[P,K,page_size,H]`, pos `[P,Kp,page_size]` (-1 empty; Kp = 1, or K once
    a head-wise policy keeps different tokens per head), and per sequence slot its block table `[B,M]`
    (page ids, the null page as padding) and length `[B]` (slots filled: a compressed row's slots hold
    fewer tokens than its positions count). With `chunk_row` (a scalar) the cache takes mixed steps (see
    the module docstring) and its view is a `RowSplit`. Quantized pages (`int:8` or `int:4`, as
    `QuantKVCache`'s int codes) hold per-token symmetric codes in k, v, packed (uint8 `[P,K,page_size,
    H * bits / 8]`), and their scales in k_scale, v_scale `[P,K,page_size,1]`; the view dequantizes the
    gathered pages. `stat` `[P,K,page_size]` (fp32): each slot's running statistic under a decode-time
    policy that accumulates one (H2O's attention received, `kvjax.paged_eviction`); a new token's is 0.
    `shared`: the layer's pages are one physical pool with the other shared layers', each layer holding its
    own block tables and lengths (PyramidKV's budgets differ per layer, `kvjax.layer_pages`; `SharedPool`).
    `ring` `[B]` (a sliding-window layer's own pool): a row's C > 0 (whole pages) makes its slots a ring
    of C, as `kvjax.cache.WindowKVCache` is under `local=true`: the n-th token held goes to slot n % C
    (slots past its length stay masked until the ring is full; past its C lie only null pages); 0 keeps
    slots as they are (the window pool's slot is a position)."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    table: jax.Array
    length: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    chunk_row: jax.Array | None = None
    stat: jax.Array | None = None
    ring: jax.Array | None = None
    bits: int | None = struct.field(pytree_node=False, default=None)  # 8 or 4: the codes' width
    windowed: bool = struct.field(pytree_node=False, default=False)  # a sliding-window layer's own pool
    shared: bool = struct.field(pytree_node=False, default=False)  # one physical pool with other layers (`SharedPool`)

    @classmethod
    def init(
        cls,
        n_pages: int,
        page_size: int,
        batch: int,
        max_pages: int,
        n_kv_heads: int,
        head_dim: int,
        dtype,
        *,
        value_dim: int | None = None,
        per_head_positions: bool = False,
        bits: int | None = None,
        stat: bool = False,
    ):
        """`bits` (8 or 4): pages of symmetric integer codes, packed, with a scale per token and head;
        `stat`: a running statistic per slot and head (decode-time eviction)."""
        if bits not in (None, 4, 8):
            raise ValueError(f"quantized pages hold 8- or 4-bit codes, not bits={bits}")
        shape = (n_pages, n_kv_heads, page_size, head_dim)
        v_shape = (*shape[:3], value_dim or head_dim)
        pos_heads = n_kv_heads if per_head_positions else 1
        scales, coded = {}, bits is not None
        if coded:
            scales = dict(k_scale=jnp.zeros((*shape[:3], 1), dtype), v_scale=jnp.zeros((*shape[:3], 1), dtype))
            shape, v_shape = ((*x[:3], packed_width(x[3], bits)) for x in (shape, v_shape))
        return cls(
            k=jnp.zeros(shape, jnp.uint8 if coded else dtype),
            v=jnp.zeros(v_shape, jnp.uint8 if coded else dtype),
            pos=jnp.full((n_pages, pos_heads, page_size), -1, jnp.int32),
            table=jnp.zeros((batch, max_pages), jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
            stat=jnp.zeros(shape[:3], jnp.float32) if stat else None,
            bits=bits,
            **scales,
        )

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def page_nbytes(self) -> int:
        """Bytes one page takes: its K, V, positions (and int8 scales, running statistics)."""
        return sum(pool[0].nbytes for pool in self._pools().values())

    @property
    def slot_nbytes(self) -> int:
        """Bytes one sequence slot holds beside the pages (KIVI's residual, DuoAttention's streaming heads): none."""
        return 0

    def _pools(self) -> dict[str, jax.Array]:
        """The page arrays `[P,X,...]`: a page's bytes, what a page copy moves and a mesh splits over X (the KV
        heads); the per-slot ones `[P,X,page_size,...]` are those a write fills."""
        pools = dict(k=self.k, v=self.v, pos=self.pos)
        pools |= dict(k_scale=self.k_scale, v_scale=self.v_scale) if self.quantized else {}
        return pools | (dict(stat=self.stat) if self.stat is not None else {})

    def _carried(self) -> dict[str, jax.Array]:
        """What a step writes and the engine keeps (its tables and lengths are the engine's): the pools."""
        return self._pools()

    def _flat_slots(self, index: jax.Array, ok: jax.Array) -> jax.Array:
        """Pool slots (page * page_size + offset) of the rows' slot indices `[B,T]`; not `ok`, past the
        table, or on the null page: one past the pool (dropped by the writes)."""
        ps = self.page_size
        column = jnp.minimum(index // ps, self.table.shape[1] - 1)
        page = jnp.take_along_axis(self.table, column, axis=1)
        ok = ok & (page != NULL_PAGE) & (index // ps < self.table.shape[1])
        return jnp.where(ok, page * ps + index % ps, self.k.shape[0] * ps)

    def _ringed(self, index: jax.Array, ring: jax.Array | None = None) -> jax.Array:
        """Row slot indices `[B,T]` of the n-th tokens held `index`: n % C in a row that is a compressed ring
        of C slots (`ring`, by default the cache's), n elsewhere."""
        ring = self.ring if ring is None else ring
        if ring is None:
            return index
        return jnp.where(ring[:, None] > 0, index % jnp.maximum(ring, 1)[:, None], index)

    def slots(self, pos: jax.Array) -> jax.Array:
        """Flat pool slots `[B,T]` of a chunk appended after each row's length (padding, pos < 0, goes nowhere)."""
        index = self.length[:, None] + jnp.arange(pos.shape[1], dtype=jnp.int32)[None, :]
        return self._flat_slots(self._ringed(index), pos >= 0)

    def _write(self, flat: jax.Array, **values: jax.Array) -> PagedKVCache:
        """Per-slot values `[N,X,...]` (k, v `[N,K,H]`, pos `[N,Kp]`, scales) into the flat pool slots `[N]`;
        full-precision k, v are quantized first when the pages hold codes."""
        if self.quantized and "k" in values and "k_scale" not in values:
            for name in ("k", "v"):
                codes, scale, _ = quantize(values[name], self.bits, values[name].shape[-1], symmetric=True)
                values[name], values[f"{name}_scale"] = pack(codes, self.bits), scale  # scale [N,K,1]
        return self._scatter(flat, **values)

    def _scatter(self, flat: jax.Array, **values: jax.Array) -> PagedKVCache:
        """Per-slot values `[N,X,...]` as given into the flat pool slots `[N]` of the named pools."""
        page, offset = flat // self.page_size, flat % self.page_size  # dropped slots: page P, out of range

        def write(pool, new):  # pool [P,X,ps,...]: slot (page, offset) of every head gets new [N,X,...]
            return pool.at[page, :, offset].set(new.astype(pool.dtype), mode="drop")

        pools = self._pools()
        return self.replace(**{name: write(pools[name], new) for name, new in values.items()})

    def _mixed_slots(self, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A mixed step's flat pool slots `[R + C]` for positions `[1, R + C]` (see the module docstring)
        and the tokens each slot's row gains `[R]`."""
        R = self.table.shape[0]
        decode, chunk = pos[0, :R] >= 0, pos[0, R:] >= 0
        row = self.chunk_row
        at = self.length[row] + jnp.arange(chunk.shape[0], dtype=jnp.int32)
        flat_chunk = self.replace(table=self.table[row][None])._flat_slots(at[None], chunk[None])[0]
        flat_decode = self._flat_slots(self._ringed(self.length[:, None]), decode[:, None])[:, 0]
        added = decode.astype(jnp.int32).at[row].add(chunk.sum(dtype=jnp.int32))
        return jnp.concatenate([flat_decode, flat_chunk]), added

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PagedKVCache, KVView]:
        """Write a chunk k `[B,T,K,H]`, v `[B,T,K,Hv]` at positions `[B,T]` (a mixed step: `[1, R + C, ...]`)
        and return the view of every row's pages."""
        P, K, ps, _ = self.k.shape
        B = 1 if self.chunk_row is not None else self.table.shape[0]
        if k.ndim != 4 or k.shape[0] != B or k.shape[2] != K or v.shape[:3] != k.shape[:3] or pos.shape != k.shape[:2]:
            raise ValueError(f"new k {k.shape} / v {v.shape} / pos {pos.shape} must be [B={B}, T, K={K}, H]")
        if self.chunk_row is None:
            flat, added = self.slots(pos).reshape(-1), (pos >= 0).sum(axis=1, dtype=jnp.int32)
        else:
            if pos.shape[1] < self.table.shape[0]:
                raise ValueError(
                    f"a mixed step's {pos.shape[1]} tokens must start with one per row ({self.table.shape[0]})"
                )
            flat, added = self._mixed_slots(pos)
        Kp = self.pos.shape[1]
        fresh = {} if self.stat is None else dict(stat=jnp.zeros((flat.shape[0], K), jnp.float32))
        new = self._write(
            flat,
            k=k.reshape(-1, K, k.shape[-1]),
            v=v.reshape(-1, K, v.shape[-1]),
            pos=jnp.broadcast_to(pos[..., None], (*pos.shape, Kp)).reshape(-1, Kp),
            **fresh,
        )
        new = new.replace(length=self.length + added)
        return new, new.view()

    def load(self, row: int, n: jax.Array, pos: jax.Array, **values: jax.Array) -> PagedKVCache:
        """Fill slots [0, n) of sequence slot `row` (its table set) from one row of a dense head-major
        cache: positions `[S]` or per head `[K,S]`, and k, v `[K,S,H]` (full precision; or, for quantized
        pages, packed int:8 or int:4 codes with k_scale, v_scale `[K,S,1]`, as `QuantKVCache` stores them)."""
        Kp = self.pos.shape[1]
        pos = pos[None] if pos.ndim == 1 else pos
        if pos.shape[0] not in (1, Kp):
            raise ValueError(f"positions for {pos.shape[0]} heads; the pool keeps {Kp} per slot")
        S = pos.shape[1]
        index = jnp.arange(S, dtype=jnp.int32)[None]
        flat = self.replace(table=self.table[row][None])._flat_slots(index, index < n)[0]
        slot_major = {name: jnp.moveaxis(x, 1, 0) for name, x in values.items()}  # [K,S,...] -> [S,K,...]
        new = self._write(flat, pos=jnp.broadcast_to(pos, (Kp, S)).T, **slot_major)
        return new.replace(length=new.length.at[row].set(n))

    def load_positions(self, row: int, pos: jax.Array, **values: jax.Array) -> PagedKVCache:
        """Fill sequence slot `row`'s slots at its tokens' positions from one row of a sliding-window
        layer's ring (positions `[W]`, -1 empty; k, v `[K,W,H]`): a window pool's slot is the token's
        position, and a token whose page the window has left (or never held) is dropped. The row's other
        slots below its length are emptied first: a page from the free list keeps its last owner's positions,
        which the row's queries would otherwise see where the ring holds no token (before its window)."""
        mine = self.replace(table=self.table[row][None])
        every = jnp.arange(self.table.shape[1] * self.page_size, dtype=jnp.int32)[None]
        emptied = mine._flat_slots(every, every <= pos.max())[0]
        new = self._scatter(emptied, pos=jnp.full((emptied.shape[0], self.pos.shape[1]), -1, jnp.int32))
        index = pos[None]
        flat = mine._flat_slots(index, index >= 0)[0]
        slot_major = {name: jnp.moveaxis(x, 1, 0) for name, x in values.items()}
        new = new._write(flat, pos=jnp.broadcast_to(pos, (self.pos.shape[1], pos.shape[0])).T, **slot_major)
        return new.replace(length=new.length.at[row].set(pos.max() + 1))

    def view(self) -> KVView:
        """Every row's pages gathered in table order: k, v `[B,K,M*page_size,H]`, pos `[B,M*page_size]`
        (`[B,K,M*page_size]` per head). Slots at or past a row's length hold no token of it (a reused
        page keeps its old contents until overwritten): their positions read -1, so attention masks them.
        Quantized pages are dequantized after the gather (only the rows' pages). In a mixed step, the
        view of every row whose `reader` is the `RowSplit` of it and of the chunk's row."""
        if self.chunk_row is None:
            return self._gather()
        whole, row = self.replace(chunk_row=None), self.chunk_row
        ring = None if self.ring is None else self.ring[row][None]
        chunk = whole.replace(table=self.table[row][None], length=self.length[row][None], ring=ring)._gather()
        return self._split(whole._gather(), chunk, whole)

    @staticmethod
    def _split(rows: KVView, chunk: KVView, pool: PagedKVCache | None) -> KVView:
        return rows._replace(reader=RowSplit(rows, chunk, pool))

    def _rows_of(self, pool: jax.Array) -> jax.Array:
        """A pool `[P,X,page_size,...]` gathered in each row's table order: `[B,X,M*page_size,...]`."""
        B, M = self.table.shape
        gathered = pool.reshape(*pool.shape[:3], -1)[self.table].transpose(0, 2, 1, 3, 4)
        return gathered.reshape(B, pool.shape[1], M * self.page_size, *pool.shape[3:])

    def prompt_rows(self, pool: jax.Array) -> jax.Array:
        """K or V pages `[P,K,page_size,H]` in each row's table order, `[B,K,M*page_size,H]`, one slot a
        token: how the prefix cache's pages of whole prompts read back (`engine._gather_prefix`)."""
        return self._rows_of(pool)

    def _mine(self) -> jax.Array:
        """`[B,1,M*page_size]`: the row slots below each row's length."""
        return (
            jnp.arange(self.table.shape[1] * self.page_size, dtype=jnp.int32)[None, None, :]
            < self.length[:, None, None]
        )

    def stat_view(self) -> jax.Array:
        """Each row's running statistics `[B,K,M*page_size]` in its slots' order (0 past its length)."""
        return jnp.where(self._mine(), self._rows_of(self.stat), 0.0)

    def dense(self, slots: int) -> KVCache:
        """Every row's pages as a dense cache of their view's width (decode-time eviction re-selects it); a
        ring's first `slots` (a window compressed under `local=true`), as `WindowKVCache` holds them."""
        view = self.view()
        if self.ring is None:
            return KVCache(k=view.k, v=view.v, pos=view.pos, length=self.length)
        pos = view.pos[..., :slots]
        return WindowKVCache(k=view.k[:, :, :slots], v=view.v[:, :, :slots], pos=pos, length=self.length)

    def compact(self, rows: jax.Array, dense: KVCache) -> PagedKVCache:
        """Rewrite the slots of the sequence slots `rows` (`[B]` bool) from a dense cache of their view's
        width (k, v `[B,K,S,H]`, positions `[B,S]` or `[B,K,S]`): decode-time eviction's re-selection,
        compacted in place within the pages each row holds."""
        k, v, pos = dense.k, dense.v, dense.pos
        B, K, S = k.shape[:3]
        index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
        pos = jnp.broadcast_to(pos if pos.ndim == 3 else pos[:, None], (B, self.pos.shape[1], S))
        flat = self._flat_slots(index, rows[:, None]).reshape(-1)
        new = self._write(flat, k=_slot_major(k), v=_slot_major(v), pos=_slot_major(pos))
        return new.replace(length=jnp.where(rows, dense.length, self.length))

    def with_stat(self, stat: jax.Array, rows: jax.Array | None = None) -> PagedKVCache:
        """Store each row's running statistics `[B,X,S]` (S its view's width, or a ring's): at every slot of the rows
        `rows` (`[B]` bool; just compacted), at the filled ones of the others."""
        B, _, S = stat.shape
        index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
        ok = self._mine()[:, 0, :S]
        ok = ok if rows is None else ok | rows[:, None]
        return self._write(self._flat_slots(index, ok).reshape(-1), stat=_slot_major(stat))

    def _gather(self) -> KVView:
        pos = jnp.where(self._mine(), self._rows_of(self.pos), -1)  # [B,Kp,M*ps]
        pos = pos[:, 0] if pos.shape[1] == 1 else pos
        if not self.quantized:
            return KVView(self._rows_of(self.k), self._rows_of(self.v), pos, paged=self)
        return KVView(*(self._values(self._rows_of(c), self._rows_of(s)) for c, s in self._coded()), pos)

    def _coded(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        return (self.k, self.k_scale), (self.v, self.v_scale)

    def _values(self, codes: jax.Array, scale: jax.Array) -> jax.Array:
        """Packed codes `[..., H * bits / 8]` and their scales `[..., 1]` -> fp32 values `[..., H]`."""
        unpacked = unpack(codes, self.bits)
        return dequantize(unpacked, scale, None, self.bits, unpacked.shape[-1])

    def attend_pool(self, q: jax.Array, q_pos: jax.Array, window: int | None, scale=None, softcap=None) -> jax.Array:
        """One query per row, q `[B,1,N,H]` at q_pos `[B,1]`, over every slot of the pool, each row's
        softmax restricted to its own pages' slots below its length: the same keys as the gathered view,
        but every page is read once for all rows and nothing is copied per row. XLA's decode path where
        `pool_is_cheaper` (the rows' tables span the pool, and the copy saved outweighs the logits of
        every row against every page: SmolLM2's 16 rows over 74 pages, not the demo's 32 over 1,934)."""
        (P, K, ps, _), H = self.k.shape, q.shape[-1]  # packed codes are narrower than the head
        B, M = self.table.shape
        N, Kp = q.shape[2], self.pos.shape[1]
        scale = H**-0.5 if scale is None else scale
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        # [B,P]: where each page sits in each row's table (-1: absent). The null page pads a table after
        # its pages, so its column lies past the row's length, which masks it like any unwritten slot.
        column = jnp.full((B, P), -1, jnp.int32).at[rows, self.table].max(jnp.arange(M, dtype=jnp.int32)[None])
        mine = (column[:, :, None] >= 0) & (
            column[:, :, None] * ps + jnp.arange(ps)[None, None] < self.length[:, None, None]
        )
        k_pos = jnp.where(mine[:, :, None], self.pos[None], -1).transpose(0, 2, 1, 3).reshape(B, Kp, P * ps)
        k_pos = k_pos[:, 0] if Kp == 1 else k_pos
        if self.quantized:
            keys, values = (self._values(c, s) for c, s in self._coded())
        else:
            keys, values = self.k, self.v
        keys, values = (x.transpose(1, 0, 2, 3).reshape(K, P * ps, x.shape[-1]) for x in (keys, values))  # head-major
        # Rows and their query heads as one M = B*G axis per KV head: on XLA:CPU the value product in
        # this layout ran several times faster than with the rows as a batch axis before the heads (a
        # one-off comparison of scripts/bench_serving.py's step time when the layout was chosen).
        G = N // K
        q_KMH = q.reshape(B, K, G, H).transpose(1, 0, 2, 3).reshape(K, B * G, H)
        logits = capped(jnp.einsum("KMH,KSH->KMS", q_KMH, keys, preferred_element_type=jnp.float32) * scale, softcap)
        mask = visible(q_pos, k_pos, window)  # [B,1,S] or, per head, [B,K,1,S]
        mask = jnp.broadcast_to(mask[None] if mask.ndim == 3 else mask.transpose(1, 0, 2, 3), (K, B, G, P * ps))
        probs = masked_probs(logits, mask.reshape(K, B * G, P * ps))
        out = jnp.einsum("KMS,KSH->KMH", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        out = out.reshape(K, B, G, -1).transpose(1, 0, 2, 3)
        return out.reshape(B, 1, N, values.shape[-1]).astype(q.dtype)

    def copy_pages(self, copies: list[tuple[int, int]]) -> PagedKVCache:
        """Run the allocator's copy-on-write copies (src -> dst pages; the main pool's, so a sliding-window
        layer's own pool, which shares no prefix, has none)."""
        if not copies or self.windowed:
            return self
        src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies))
        return self.replace(**{name: pool.at[dst].set(pool[src]) for name, pool in self._pools().items()})


class SharedPool:
    """Threads one physical page pool through the layers that share it (`PagedKVCache.shared`), in layer
    order: the first such layer's cache holds the pool's arrays and the others zero-size placeholders (so
    a step carries, donates and returns the pool once); `enter` hands a layer the arrays the one before it
    wrote, `leave` takes them back, `close` leaves the last ones with the first layer."""

    def __init__(self):
        self.first: int | None = None
        self.pools: dict[str, jax.Array] = {}

    def enter(self, index: int, cache):
        """`cache` (at `index` of its caches) with the pool as the layers before it left it."""
        if not getattr(cache, "shared", False):
            return cache
        if self.first is None:
            self.first = index
            return cache
        return cache.replace(**self.pools)

    def leave(self, cache):
        """`cache` after its layer wrote, the pool taken from it (a placeholder left in its place)."""
        if not getattr(cache, "shared", False):
            return cache
        self.pools = cache._pools()
        return cache.replace(**{name: x[:0] for name, x in self.pools.items()})

    def close(self, caches: list) -> list:
        """`caches` with the pool, as the last layer left it, back in the first shared layer's cache."""
        if self.first is not None:
            caches[self.first] = caches[self.first].replace(**self.pools)
        return caches


def _slot_major(x: jax.Array) -> jax.Array:
    """Rows' head-major slots `[B,X,S,...]` as one slot axis `[B*S,X,...]`, as `_write` takes them."""
    return jnp.moveaxis(x, 1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], *x.shape[3:])


@struct.dataclass
class PagedLatentCache(PagedKVCache):
    """MLA's latent cache in pages (`kvjax.cache.LatentCache`'s contract): one "KV head" whose keys are
    the latents c `[P,1,page_size,Dc]` and whose values are the RoPE keys `[P,1,page_size,Dr]`."""

    def update(self, c: jax.Array, k_rope: jax.Array, pos: jax.Array) -> tuple[PagedLatentCache, LatentView]:
        """Append c `[B,T,Dc]`, k_rope `[B,T,Dr]` at positions `[B,T]`; the view gathers each row's pages."""
        return super().update(c[:, :, None], k_rope[:, :, None], pos)

    def dense(self, slots: int) -> LatentCache:
        """Every row's latent pages as a dense `LatentCache` of their view's width (decode-time eviction)."""
        view = self.view()
        return LatentCache(c=view.c, k_rope=view.k_rope, pos=view.pos, length=self.length)

    def compact(self, rows: jax.Array, dense: LatentCache) -> PagedLatentCache:
        """`PagedKVCache.compact` from a re-selected dense `LatentCache` (its one "head": latents and RoPE keys)."""
        kv = KVCache(k=dense.c[:, None], v=dense.k_rope[:, None], pos=dense.pos, length=dense.length)
        return super().compact(rows, kv)

    def _gather(self) -> LatentView:
        view = super()._gather()
        return LatentView(view.k[:, 0], view.v[:, 0], view.pos)

    @staticmethod
    def _split(rows: LatentView, chunk: LatentView, pool) -> LatentView:
        return rows._replace(split=RowSplit(rows, chunk))  # MLA attends to the gathered latents

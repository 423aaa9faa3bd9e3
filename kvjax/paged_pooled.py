"""AdaKV's per-head budgets in pages (Feng et al. 2024, arXiv 2407.11550, sec. 4: the heads of a layer
share K x budget entries, stored flattened so that memory really shrinks): `PagedPooledCache` pages
`kvjax.cache.PooledKVCache`. A page holds `page_size` tokens' worth of entries, K of them a token, each one
KV head's key, value and position, tagged with that head; whichever heads a compressed prompt's entries
belong to, its K x budget entries fill `budget` tokens' pages, so the host (`kvjax.page_pool`, the
scheduler) counts rows in tokens as for any page, and heads keep different numbers of tokens at no cost
in pages. A new token appends K entries, one per head in head order; attention masks each query head's
view to its KV head's entries (`kvjax.ops.attention` with `k_head`), as over a dense pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, KVView, PooledKVCache, WindowPooledKVCache
from kvjax.paged import PagedKVCache, RowSplit


@struct.dataclass
class PagedPooledCache(PagedKVCache):
    """One layer's pages of pooled entries: k, v `[P,1,K*page_size,H]`, pos and head `[P,1,K*page_size]`
    (-1 and 0 where empty), and under decode-time eviction that accumulates a statistic (H2O's) a running
    sum per entry, stat `[P,1,K*page_size]`. `length` counts a row's tokens, as the host does: its entries
    are the first K x length of its pages (`heads` = K), and `page_size` counts entries (K x the host's page
    size). Full precision, one device; the slot-wise writes of other layouts (`load`, `attend_pool`) do not
    apply: a row's entries are loaded, appended and compacted in order. In a sliding-window layer's own
    pool (`windowed`, AdaKV under `local=true`) a row with `ring` C > 0 is a ring of C tokens' entries,
    loaded oldest first (`as_ring`), so that its next token's K entries go over the K oldest, as
    `kvjax.cache.WindowPooledKVCache` writes them."""

    head: jax.Array | None = None
    heads: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def init_pooled(cls, n_pages, page_size, batch, max_pages, n_kv_heads, head_dim, dtype, stat: bool = False):
        """`PagedKVCache.init`'s shapes as entries, K a token; `stat`: a running sum per entry."""
        entries = (n_pages, 1, n_kv_heads * page_size)
        return cls(
            stat=jnp.zeros(entries, jnp.float32) if stat else None,
            k=jnp.zeros((*entries, head_dim), dtype),
            v=jnp.zeros((*entries, head_dim), dtype),
            pos=jnp.full(entries, -1, jnp.int32),
            head=jnp.zeros(entries, jnp.int32),
            table=jnp.zeros((batch, max_pages), jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
            heads=n_kv_heads,
        )

    def _pools(self) -> dict[str, jax.Array]:
        return super()._pools() | dict(head=self.head)

    def _mine(self) -> jax.Array:
        """`[B,1,M*E]`: the entries below each row's K x length (E = K x page_size a page)."""
        return (
            jnp.arange(self.table.shape[1] * self.page_size, dtype=jnp.int32)[None, None, :]
            < (self.length * self.heads)[:, None, None]
        )

    def _entries(self, first: jax.Array, ok: jax.Array) -> jax.Array:
        """Flat pool slots `[B,T*K]` of T tokens appended at token index `first` `[B]` of each row (`ok`
        `[B,T]`: a token, not padding): entry n x K + h for head h of the n-th token, n = first + t (in a
        row that is a ring of C tokens' entries, n % C: `as_ring`)."""
        B, T, K = ok.shape[0], ok.shape[1], self.heads
        tokens = self._ringed(first[:, None] + jnp.arange(T, dtype=jnp.int32)[None])
        index = (tokens[:, :, None] * K + jnp.arange(K, dtype=jnp.int32)[None, None]).reshape(B, T * K)
        return self._flat_slots(index, jnp.repeat(ok, K, axis=1))

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PagedPooledCache, KVView]:
        """Write a chunk k, v `[B,T,K,H]` at positions `[B,T]` (a mixed step: `[1, R + C, ...]`) as K entries
        a token, and return the view of every row's pages."""
        B, T, K, H = k.shape
        if K != self.heads or v.shape[:3] != k.shape[:3] or pos.shape != (B, T):
            raise ValueError(f"new k {k.shape} / v {v.shape} / pos {pos.shape} must be [B, T, K={self.heads}, H]")
        if self.chunk_row is None:
            flat, added = self._entries(self.length, pos >= 0), (pos >= 0).sum(axis=1, dtype=jnp.int32)
        else:  # one decode token per row, then the chunk of row `chunk_row`
            R, row = self.table.shape[0], self.chunk_row
            decode, chunk = pos[0, :R] >= 0, pos[0, R:] >= 0
            one = self.replace(table=self.table[row][None], ring=None)  # a prompt's chunk: never a ring
            flat_chunk = one._entries(self.length[row][None], chunk[None])
            flat = jnp.concatenate([self._entries(self.length, decode[:, None]).reshape(-1), flat_chunk[0]])
            added = decode.astype(jnp.int32).at[row].add(chunk.sum(dtype=jnp.int32))
        entries = dict(
            k=k.reshape(-1, 1, H),
            v=v.reshape(-1, 1, v.shape[-1]),
            pos=jnp.repeat(pos, K, axis=1).reshape(-1, 1),
            head=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, T, K)).reshape(-1, 1),
        )
        if self.stat is not None:  # a new entry has received no attention yet
            entries["stat"] = jnp.zeros((flat.size, 1), jnp.float32)
        new = self._scatter(flat.reshape(-1), **entries).replace(length=self.length + added)
        return new, new.view()

    def load_pool(self, row: int, pool: PooledKVCache, stat: jax.Array | None = None) -> PagedPooledCache:
        """Fill sequence slot `row`'s pages (its table set) from row 0 of a compressed `PooledKVCache`, its
        entries in order: AdaKV keeps K x budget of them (`reducers.top_slots`), the row's length budget;
        with their running statistics `[B,1,P]` where the pages keep one."""
        tokens = -(-pool.length[0] // self.heads)  # a ring's kept entries need not fill their last token's K
        index = jnp.arange(pool.capacity, dtype=jnp.int32)[None]
        flat = self.replace(table=self.table[row][None])._flat_slots(index, index < tokens * self.heads)[0]
        entries = {name: getattr(pool, name)[0][:, None] for name in ("k", "v", "pos", "head")}
        if self.stat is not None:
            entries["stat"] = stat[0, 0][:, None]
        new = self._scatter(flat, **entries)
        return new.replace(length=new.length.at[row].set(tokens))

    def dense(self, entries: int) -> PooledKVCache:
        """Every row's entries as a dense pool of their view's width (decode-time eviction re-selects it;
        `entries`: that width); a ring's first `entries` (C x K), as `WindowPooledKVCache` holds them."""
        view = self.view()
        if self.ring is None:
            return PooledKVCache(k=view.k, v=view.v, pos=view.pos, head=view.head, length=self.length * self.heads)
        k, v, pos, head = (x[:, :entries] for x in (view.k, view.v, view.pos, view.head))
        return WindowPooledKVCache(k=k, v=v, pos=pos, head=head, length=self.length * self.heads)

    def compact(self, rows: jax.Array, dense: PooledKVCache) -> PagedPooledCache:
        """Rewrite the entries of the sequence slots `rows` (`[B]` bool) from a dense pool of their view's
        width, its entries in order (K x budget after a re-selection, `reducers.top_slots`)."""
        B, S = dense.pos.shape
        index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
        flat = self._flat_slots(index, rows[:, None]).reshape(-1)
        entries = {name: getattr(dense, name).reshape(B * S, 1, -1) for name in ("k", "v")}
        entries |= {name: getattr(dense, name).reshape(B * S, 1) for name in ("pos", "head")}
        new = self._scatter(flat, **entries)
        return new.replace(length=jnp.where(rows, -(-dense.length // self.heads), self.length))

    def prompt_rows(self, pool: jax.Array) -> jax.Array:
        """A whole prompt's entries (K a token, in token order: `as_entries`) as K or V `[B,K,M*page_size,H]`."""
        B, M = self.table.shape
        x = self._rows_of(pool)[:, 0]
        return x.reshape(B, M * self.page_size // self.heads, self.heads, x.shape[-1]).transpose(0, 2, 1, 3)

    def _gather(self) -> KVView:
        """Every row's entries in table order: k, v `[B,M*E,H]`, pos and head `[B,M*E]` (-1 past its length)."""
        pos = jnp.where(self._mine(), self._rows_of(self.pos), -1)[:, 0]
        k, v, head = (self._rows_of(x)[:, 0] for x in (self.k, self.v, self.head))
        return KVView(k, v, pos, head)

    def _split(self, rows: KVView, chunk: KVView, pool) -> KVView:
        """A mixed step's reader: each part over its rows' gathered entries (no whole-pool path)."""
        return rows._replace(reader=RowSplit(rows, chunk, heads=self.heads))


def as_entries(cache: KVCache) -> PooledKVCache:
    """A dense cache of whole tokens (positions `[B,S]`) as entries, K a slot in slot order, as new tokens
    are appended: so page p of a whole prompt holds its tokens p x page_size on (the prefix cache's pages)."""
    B, K, S, H = cache.k.shape
    entries = lambda x: x.transpose(0, 2, 1, 3).reshape(B, S * K, x.shape[-1])  # noqa: E731
    return PooledKVCache(
        k=entries(cache.k),
        v=entries(cache.v),
        pos=jnp.repeat(cache.pos, K, axis=1),
        head=jnp.broadcast_to(jnp.tile(jnp.arange(K, dtype=jnp.int32), S), (B, S * K)),
        length=cache.length * K,
    )


def as_ring(pool: PooledKVCache, stat: jax.Array | None = None) -> tuple[PooledKVCache, jax.Array | None]:
    """A compressed pool's entries sorted by position, empty ones last, and their running statistics `[B,1,E]`
    (if any) with them: the order an entry ring of the window pool holds them in. Written at n x K + h for
    its n-th token (n % C), the ring then always writes a token over its K oldest entries (oldest first, as
    they were loaded and as new ones follow), what `WindowPooledKVCache` writes over: out of every later
    query's window once C >= the window (with at most K (W - 1) entries live before a token is written, K or
    more of its C x K are dead, and they are the oldest)."""
    order = jnp.argsort(jnp.where(pool.pos >= 0, pool.pos, jnp.iinfo(jnp.int32).max), axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order.reshape(*order.shape, *(1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    pool = pool.replace(k=take(pool.k), v=take(pool.v), pos=take(pool.pos), head=take(pool.head))
    return pool, None if stat is None else jnp.take_along_axis(stat, order[:, None], axis=2)

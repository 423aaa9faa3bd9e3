"""DuoAttention in pages (Xiao et al. 2024, arXiv 2410.10819, sec. 3.2; `kvjax.duo` holds the method): a
layer's retrieval heads keep every token, so their K/V are the engine's pages (`[P,Kr,page_size,H]`, the
layer's Kr retrieval heads only); its streaming heads keep a constant `sinks` + `recent` tokens, so they
are not paged but held per sequence slot beside the pages, as `kvjax.slot_states` holds a recurrent state
and `kvjax.paged_kivi` a residual. A request's pages then grow with its retrieval heads alone.

The prompt is prefilled whole by the Generator (every head attends fully, as in the reference), split by
`DuoKVCache.from_cache` and loaded (`load_duo`); each decode token goes to the pages (retrieval heads) and
to the row's sinks and ring (streaming heads) exactly as `DuoKVCache.update` writes them, so a request
decodes as `Generator` decodes it alone. A step feeds one token per decode row (no prompt chunk: the
tokens a preempted request had generated are re-fed a step each, `Work.stepwise`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.cache import KVCache, KVView, RingKVCache
from kvjax.duo import DuoKVCache, _DuoView
from kvjax.paged import PagedKVCache


class _DecodeRows(NamedTuple):
    """`KVView.reader` of a decode step: the step's R queries `[1,R,...]` as R rows of one query, each over
    its own retrieval pages and streaming tokens (`_DuoView`)."""

    duo: _DuoView

    def attend(self, q, q_pos, impl, window=None, softcap=None):
        out = self.duo.attend(q[0][:, None], q_pos[0][:, None], impl, window, softcap)
        return out.reshape(1, q.shape[1], *out.shape[2:])


def _take(cache: KVCache, rows: jax.Array) -> KVCache:
    """Rows `rows` `[B]` of per-slot caches (a row past the slots: empty)."""
    fill = dict(k=0, v=0, pos=-1, length=0)
    return cache.replace(**{f: getattr(cache, f).at[rows].get(mode="fill", fill_value=x) for f, x in fill.items()})


def _put(cache: KVCache, rows: jax.Array, new: KVCache) -> KVCache:
    """`cache` with slots `rows` `[B]` set to the rows of `new` (a row past the slots: dropped)."""
    fields = ("k", "v", "pos", "length")
    return cache.replace(**{f: getattr(cache, f).at[rows].set(getattr(new, f), mode="drop") for f in fields})


_SLOTTED = dict(sink="sink", ring="recent_ring")  # `DuoKVCache` field -> `PagedDuoCache` field


@struct.dataclass
class PagedDuoCache(PagedKVCache):
    """One layer's DuoAttention cache in the engine: pages of its `retrieval` KV heads (k, v
    `[P,Kr,page_size,H]`, positions, tables and lengths as any page); per sequence slot its `streaming` heads'
    first `sinks` positions (`sink`, a `KVCache` `[S,Ks,sinks,H]`) and a ring of their last `recent` ones
    (`recent_ring`, a `RingKVCache` `[S,Ks,recent,H]`), None without streaming heads; `slot_rows` `[B]`: each table
    row's sequence slot (S for an empty row)."""

    sink: KVCache | None = None
    recent_ring: RingKVCache | None = None
    slot_rows: jax.Array | None = None
    retrieval: tuple[int, ...] = struct.field(pytree_node=False, default=())
    streaming: tuple[int, ...] = struct.field(pytree_node=False, default=())
    sinks: int = struct.field(pytree_node=False, default=0)
    recent: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def init_duo(
        cls,
        streaming: tuple[int, ...],
        sinks: int,
        recent: int,
        n_pages: int,
        page_size: int,
        batch: int,
        max_pages: int,
        K: int,
        H: int,
        dtype,
    ) -> PagedDuoCache:
        """Pages of the heads not `streaming` (of K), and `batch` sequence slots of the streaming heads'."""
        retrieval = tuple(h for h in range(K) if h not in streaming)
        pages = PagedKVCache.init(n_pages, page_size, batch, max_pages, len(retrieval), H, dtype)
        Ks = len(streaming)
        sink = KVCache.init(batch, sinks, Ks, H, dtype) if Ks and sinks else None
        ring = RingKVCache.init(batch, recent, Ks, H, dtype) if Ks else None
        return cls(
            **{f.name: getattr(pages, f.name) for f in dataclasses.fields(pages)},
            sink=sink,
            recent_ring=ring,
            slot_rows=jnp.full((batch,), batch, jnp.int32),
            retrieval=retrieval,
            streaming=tuple(streaming),
            sinks=sinks,
            recent=recent,
        )

    def _slotted(self) -> dict[str, KVCache]:
        """The per-sequence-slot caches (leading axis the slot), by `DuoKVCache`'s name for them: the
        streaming heads' sinks and ring."""
        return {name: getattr(self, field) for name, field in _SLOTTED.items() if getattr(self, field) is not None}

    def _with_slotted(self, rows: jax.Array, dense: DuoKVCache) -> PagedDuoCache:
        """These caches with sequence slots `rows` `[B]` set from the rows of `dense`'s sinks and ring."""
        parts = self._slotted().items()
        return self.replace(**{_SLOTTED[name]: _put(part, rows, getattr(dense, name)) for name, part in parts})

    def _carried(self) -> dict:
        return self._pools() | {field: getattr(self, field) for field in _SLOTTED.values()}

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one sequence slot: its streaming heads' sinks and ring, their positions and lengths."""
        return sum(x[0].nbytes for x in jax.tree.leaves(self._slotted()))

    def load_duo(self, row: int, dense: DuoKVCache) -> PagedDuoCache:
        """Sequence slot `row` (its table set) from row 0 of a Generator's `DuoKVCache`: the retrieval heads'
        tokens into its pages, the streaming heads' sinks and ring into its sequence slot. A layer of streaming
        heads alone keeps positions only (its pages hold no head), those of the whole prompt. A sliding-window
        layer's pages (`windowed`, under local=true) take the retrieval heads' ring at its tokens' positions."""
        full = dense.full
        if full is None:  # a prompt's every position, 0..n-1: the sinks and the ring counted all of them
            n = dense.ring.length[0] + (0 if dense.sink is None else dense.sink.length[0])
            at = jnp.arange(self.table.shape[1] * self.page_size, dtype=jnp.int32)
            pos, values = jnp.where(at < n, at, -1), {}
        else:
            n, pos, values = full.length[0], full.pos[0], dict(k=full.k[0], v=full.v[0])
        new = self.load_positions(row, pos, **values) if self.windowed else self.load(row, n, pos, **values)
        return new._with_slotted(self.slot_rows[row][None], dense)

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PagedDuoCache, KVView]:
        """A decode token per row (k, v `[1,B,K,H]`, pos `[1,B]`, -1 where a row feeds none): the retrieval
        heads' into the pages, the streaming heads' into the row's sinks or ring; the view attends each row's
        query heads over their own part (`_DuoView`)."""
        B = self.table.shape[0]
        if self.chunk_row is None or k.shape[:2] != (1, B) or pos.shape != (1, B):
            raise ValueError(
                f"DuoAttention's pages take one decode token per row ({B} rows), not k {k.shape} at pos "
                f"{pos.shape}: a prompt is loaded whole (load_duo) and generated tokens are re-fed a step at a time"
            )
        if self.retrieval:
            r = np.asarray(self.retrieval, np.int32)
            new, full = PagedKVCache.update(self, k[:, :, r], v[:, :, r], pos)
            full = full.reader.rows  # (each row's own pages)
        else:  # pages of no head: the positions alone, which count the row's tokens
            flat, added = self._mixed_slots(pos)
            new, full = self._scatter(flat, pos=pos.reshape(-1, 1)).replace(length=self.length + added), None
        stream = None
        if self.streaming:  # `DuoKVCache.update` on the rows' slots, a row a sequence of one token
            parts = {name: _take(part, self.slot_rows) for name, part in self._slotted().items()}
            dense = DuoKVCache(None, parts.get("sink"), parts["ring"], (), self.streaming, self.sinks, self.recent)
            dense, seen = dense.update(k[0][:, None], v[0][:, None], pos[0][:, None])
            new, stream = new._with_slotted(self.slot_rows, dense), seen.reader.stream
        main = full if full is not None else stream
        return new, KVView(main.k, main.v, main.pos, reader=_DecodeRows(_DuoView(new, full, stream)))

"""Pages for layers that keep different numbers of tokens (PyramidKV's budgets, Cai et al. 2024, sec.
3.3): one pool of single-layer pages that every such layer takes from, and a block table per sequence
and layer, as vLLM gives each layer its own KV tensor view of one block pool. A fixed pool per layer
would need its share fixed in advance, and the right share depends on the prompts and generations in
flight (the top layer keeps about budget / beta of a prompt but every generated token).

`LayerPages` is the host side (`kvjax.page_pool.PagePool`'s interface to the scheduler, which sees one
sequence per request); the device side is `kvjax.paged.SharedPool`, which threads the one pool's arrays
through the layers. Under eviction while decoding (`every=`) every layer is re-selected at the same step,
each down to its own budget, and the device's per-layer lengths come back (`truncate`).
"""

from __future__ import annotations

import numpy as np

from kvjax.page_pool import PagePool, PoolExhausted


class LayerPages:
    """`n_layers` layers' pages from one `PagePool` of `n_layers * (n_pages - 1)` single-layer pages (the
    memory of `n_pages` pages over every layer, one null page), each sequence holding a table per layer.
    A sequence's layer l holds its length plus `offsets[l]` tokens (<= 0: its compressed prompt's budget in
    that layer less the largest, `shape`; after an eviction, what each layer kept less the largest,
    `truncate`), so the scheduler reserves, advances and releases it as one sequence of its largest
    layer's length. No prefix cache: a hit would need every layer's pages."""

    def __init__(self, n_pages: int, page_size: int, n_layers: int):
        if n_layers < 1:
            raise ValueError(f"n_layers={n_layers} must be >= 1")
        self.pool = PagePool(n_layers * (n_pages - 1) + 1, page_size)
        self.n_layers, self.page_size, self.n_pages = n_layers, page_size, self.pool.n_pages
        self.lengths: dict[object, int] = {}  # slots of the sequence's largest layer
        self.offsets: dict[object, np.ndarray] = {}  # now
        # after its prompt's compression (offsets), and the most slots each layer holds
        self.shapes: dict[object, tuple[np.ndarray, np.ndarray]] = {}
        self.hits = self.misses = 0

    @property
    def used_pages(self) -> int:
        """Single-layer pages some sequence references."""
        return self.pool.used_pages

    def pages_for(self, tokens: int) -> int:
        return self.pool.pages_for(tokens)

    def shape(self, seq, counts, most) -> None:
        """Sequence `seq`'s compressed prompt keeps `counts[l]` tokens in layer l, which holds at most
        `most[l]` slots while it decodes (before it is admitted)."""
        counts, most = np.asarray(counts, np.int64), np.asarray(most, np.int64)
        if counts.shape != (self.n_layers,) or most.shape != counts.shape:
            raise ValueError(
                f"counts {counts.shape} and most {most.shape} must give each of the {self.n_layers} layers its slots"
            )
        self.shapes[seq] = counts - counts.max(), most

    def layer_slots(self, seq, length: int) -> np.ndarray:
        """Each layer's slots when `seq`'s largest layer holds `length` (none before its prompt is in)."""
        return length + self.offsets[seq] if length else np.zeros(self.n_layers, np.int64)

    def most_pages(self, seq) -> int:
        """The most pages `seq` holds over its layers at once (each layer's at its most, as before its
        eviction while decoding they all are)."""
        return sum(self.pool.pages_for(int(n)) for n in self.shapes[seq][1])

    def admit(self, seq, prompt=None, limit: int | None = None) -> int:
        if prompt is not None:
            raise ValueError("pages per layer take no prefix cache")
        for layer in range(self.n_layers):
            self.pool.admit((seq, layer))
        self.lengths[seq], self.offsets[seq] = 0, self.shapes[seq][0]
        return 0

    def reserve(self, seq, new_tokens: int) -> list:
        """Room for `new_tokens` more slots of `seq`'s largest layer, and as many more in each other layer;
        raises PoolExhausted, taking nothing, when the free pages do not suffice for them all."""
        now, then = self.layer_slots(seq, self.lengths[seq]), self.layer_slots(seq, self.lengths[seq] + new_tokens)
        tables = [self.pool.tables[(seq, layer)] for layer in range(self.n_layers)]
        need = sum(max(0, self.pool.pages_for(int(n)) - len(t)) for n, t in zip(then, tables))
        if need > len(self.pool.free):
            raise PoolExhausted(f"sequence {seq!r} needs {need} pages; {len(self.pool.free)} are free")
        for layer, (a, b) in enumerate(zip(now, then)):
            self.pool.reserve((seq, layer), int(b - a))
        return []

    def advance(self, seq, n: int) -> None:
        now, then = self.layer_slots(seq, self.lengths[seq]), self.layer_slots(seq, self.lengths[seq] + n)
        for layer, (a, b) in enumerate(zip(now, then)):
            self.pool.advance((seq, layer), int(b - a))
        self.lengths[seq] += n

    def truncate(self, seq, lengths) -> None:
        """`seq`'s layers now hold `lengths[l]` slots each (eviction while decoding re-selected them): the
        pages past them go back to the pool."""
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != (self.n_layers,):
            raise ValueError(f"lengths {lengths.shape} must give each of the {self.n_layers} layers its slots")
        for layer, n in enumerate(lengths):
            self.pool.truncate((seq, layer), int(n))
        self.lengths[seq], self.offsets[seq] = int(lengths.max()), lengths - lengths.max()

    def release(self, seq) -> None:
        for layer in range(self.n_layers):
            self.pool.release((seq, layer))
        del self.lengths[seq]

    def forget(self, seq) -> None:
        """Drop an ended sequence's layer budgets."""
        self.offsets.pop(seq, None)
        self.shapes.pop(seq, None)

    def table(self, seqs, width: int) -> np.ndarray:
        """Block tables `[len(seqs), n_layers, width]` (None: empty rows)."""
        return np.stack(
            [
                self.pool.table([None if s is None else (s, layer) for s in seqs], width)
                for layer in range(self.n_layers)
            ],
            axis=1,
        )

    def layer_lengths(self, seqs) -> np.ndarray:
        """Slots each layer of each row's sequence holds `[len(seqs), n_layers]` (None: 0)."""
        zero = np.zeros(self.n_layers, np.int64)
        return np.stack([zero if s is None else self.layer_slots(s, self.lengths[s]) for s in seqs]).astype(np.int32)

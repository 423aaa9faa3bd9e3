"""The pages of an engine's sliding-window layers (host bookkeeping, as `kvjax.page_pool` for the rest): a
sequence holds only the pages its next queries can see, and hands back each page its window has left.

Sliding-window layers (Gemma's local layers, a model-wide window) get a pool of their own and a block
table of their own, in the same logical columns as the other layers' (column j: the sequence's slots
[j * page_size, (j + 1) * page_size)). Before a step that writes a sequence's slots [L, L + n), the
sequence must hold the columns from the one of slot L - W + 1 (the oldest key its first new query
sees, W the window) to the one of slot L + n - 1; every column before is freed (the table points it at
the null page, whose slots are empty, so attention skips it as it skips any unwritten slot). A decoding
sequence thus holds at most ceil(W / page_size) + 1 pages per layer, a prefilling one that plus its
chunk's, and never more than its own positions take (`reserve`). By default the pool is sized so that it
never runs out: every slot at its decode need, one at the chunk's. A smaller pool (`n_pages`, what a memory
budget buys) never runs out either: the scheduler admits a request only while the reservations of those
running, and the one prefilling chunk's extra (`slack`), fit it (`Scheduler(window_pages=)`).
A prefix hit would skip tokens whose window pages were never written, so the engine turns the prefix
cache off when it frees window pages.
"""

from __future__ import annotations

import numpy as np

from kvjax.page_pool import NULL_PAGE


class WindowPages:
    """Window pages of up to `slots` sequences of at most `max_pages` pages (block-table columns) with
    windows of `window` tokens, pages of `page_size`, at most `decode_ahead` tokens written a step while
    decoding and `chunk` while prefilling; `n_pages` (the null page included): a pool of that size, by
    default `pool_pages(slots)`."""

    def __init__(
        self,
        *,
        window: int,
        page_size: int,
        slots: int,
        chunk: int,
        decode_ahead: int,
        max_pages: int,
        n_pages: int | None = None,
    ):
        self.window, self.page_size = window, page_size
        self.per_decode = min(self.need(decode_ahead), max_pages)  # requests shorter than the window: all
        self.per_chunk = min(self.need(max(chunk, decode_ahead)), max_pages)
        self.n_pages = self.pool_pages(slots) if n_pages is None else n_pages
        self.free = list(range(self.n_pages - 1, NULL_PAGE, -1))
        self.held: dict[int, dict[int, int]] = {}  # sequence -> {column: page}
        self.peak = 0  # the most pages one sequence held at once

    def pool_pages(self, slots: int) -> int:
        """Pages (the null page included) that `slots` sequences can hold at once: one prefilling a chunk,
        the others decoding."""
        return (slots - 1) * self.per_decode + self.per_chunk + 1

    @property
    def slack(self) -> int:
        """Pages the one sequence prefilling a chunk may hold beyond its decode reservation."""
        return self.per_chunk - self.per_decode

    def reserve(self, positions: int, ring: int | None = None) -> int:
        """The most pages a sequence of `positions` tokens holds while it decodes: its window's, or all of
        its positions' when fewer (its columns end at its last position); a ring that takes at most `ring`
        tokens into its slots, at most their pages."""
        pages = min(self.per_decode, -(-positions // self.page_size))
        return pages if ring is None else min(pages, -(-ring // self.page_size))

    def need(self, ahead: int) -> int:
        """The most pages a sequence holds before writing `ahead` tokens: its window and them."""
        return -(-(self.window - 1 + ahead) // self.page_size) + 1

    def table(self, seqs: list, lengths: list[int], ahead: list[int], width: int, running, rings=None) -> np.ndarray:
        """Block-table rows `[len(seqs), width]` for a step writing `ahead[i]` tokens after `lengths[i]`
        for sequence seqs[i] (None: an empty row); sequences not in `running` give their pages back. A
        sequence in `rings` (sequence -> C) is a ring of C slots (a window compressed under `local=true`,
        `lengths[i]` the tokens it took): it holds the columns its tokens fill, at most ceil(C / page_size),
        then writes over them in turn until it ends."""
        rings = rings or {}
        for seq in [s for s in self.held if s not in running]:
            self.free.extend(self.held.pop(seq).values())
        table = np.full((len(seqs), width), NULL_PAGE, np.int32)
        for row, (seq, length, n) in enumerate(zip(seqs, lengths, ahead)):
            if seq is None:
                continue
            held = self.held.setdefault(seq, {})
            if seq in rings:
                first, last = 0, -(-min(rings[seq], length + n) // self.page_size)
            else:
                first = max(0, length - self.window + 1) // self.page_size
                last = min(width, -(-(length + n) // self.page_size))
            for column in [c for c in held if c < first]:
                self.free.append(held.pop(column))
            for column in range(first, last):
                if column not in held:
                    held[column] = self.free.pop()
            self.peak = max(self.peak, len(held))
            for column, page in held.items():
                table[row, column] = page
        return table

    @property
    def used_pages(self) -> int:
        return sum(len(h) for h in self.held.values())

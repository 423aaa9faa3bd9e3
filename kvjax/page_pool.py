"""Paged KV memory on the host (vLLM's block manager; PagedAttention, Kwon et al. 2023, sec. 4):
`PagePool` hands pages of a shared pool to sequences: reference-counted pages, a free list in LRU order,
copy-on-write of a shared partial last page, and a prefix cache of full pages keyed by a hash chain of
their tokens (vLLM's prefix caching, sec. 4.4 / `docs/design/prefix_caching.md`): a request whose prompt
starts with cached full pages reuses them; unreferenced cached pages stay hashed until the LRU order
hands them out again. Page 0 is the null page: never allocated, it pads block tables and holds no token.
The pages' bytes live on the device (`kvjax.paged`); this module is plain numpy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

NULL_PAGE = 0


class PoolExhausted(RuntimeError):
    """Not enough free pages for a request right now (an engine preempts or waits)."""


def page_hash(parent: bytes, tokens) -> bytes:
    """The prefix-cache key of a full page: its tokens and the key of the page before it."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


class PagePool:
    """Pages 1..n_pages-1 of `page_size` slots, handed to sequences (see the module docstring)."""

    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 2 or page_size < 1:
            raise ValueError(f"n_pages={n_pages} must be >= 2 (page 0 is the null page) and page_size={page_size} >= 1")
        self.n_pages, self.page_size = n_pages, page_size
        self.refs = np.zeros(n_pages, np.int64)
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, n_pages))  # LRU first
        self.tables: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}
        self.cached: dict[bytes, int] = {}  # hash -> page
        self.page_key: dict[int, bytes] = {}  # page -> hash
        self.hits = self.misses = 0

    # --- accounting -------------------------------------------------------------------------------
    @property
    def used_pages(self) -> int:
        """Pages some sequence references."""
        return int((self.refs > 0).sum())

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # --- sequences --------------------------------------------------------------------------------
    def admit(self, seq, prompt=None, limit: int | None = None) -> int:
        """Start `seq` with no pages; given its `prompt`, reuse the cached full pages the prompt begins
        with (at most all but its last token, which must be computed to predict the next, and at most
        `limit` tokens: then the prompt is only looked up, as a compressed one that needs fewer pages of
        its own) and count the hits and misses. Returns the prompt tokens already cached."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} is already admitted")
        self.tables[seq], self.lengths[seq] = [], 0
        if prompt is None:
            return 0
        prompt = np.asarray(prompt)
        if limit is None and self.pages_for(len(prompt)) > self.n_pages - 1:
            del self.tables[seq], self.lengths[seq]
            raise ValueError(
                f"a prompt of {len(prompt)} tokens needs {self.pages_for(len(prompt))} pages of "
                f"{self.page_size}; the whole pool has {self.n_pages - 1}"
            )
        key, most = b"", (len(prompt) - 1) // self.page_size
        for i in range(most if limit is None else min(most, limit // self.page_size)):
            key = page_hash(key, prompt[i * self.page_size : (i + 1) * self.page_size])
            page = self.cached.get(key)
            if page is None:
                break
            self._take(page)
            self.tables[seq].append(page)
        hit = len(self.tables[seq]) * self.page_size
        self.lengths[seq] = hit
        self.hits += len(self.tables[seq])
        self.misses += self.pages_for(len(prompt)) - len(self.tables[seq])
        return hit

    def reserve(self, seq, new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `new_tokens` more tokens of `seq`; returns the (src, dst) page copies to run on
        the device first (copy-on-write of a shared partial last page). Raises PoolExhausted, taking
        nothing, when the free pages do not suffice."""
        table, length = self.tables[seq], self.lengths[seq]
        need = self.pages_for(length + new_tokens) - len(table)
        partial = length % self.page_size != 0 and table and self.refs[table[-1]] > 1
        if need + bool(partial) > len(self.free):
            raise PoolExhausted(f"sequence {seq!r} needs {need + bool(partial)} pages; {len(self.free)} are free")
        copies = []
        if partial:  # the last page is shared and will be written: copy it first
            src, dst = table[-1], self._allocate()
            self._drop(src)
            table[-1] = dst
            copies.append((src, dst))
        table.extend(self._allocate() for _ in range(need))
        return copies

    def advance(self, seq, n: int) -> None:
        """Record that n more tokens of `seq` were written (into the pages `reserve` made room in)."""
        if self.pages_for(self.lengths[seq] + n) > len(self.tables[seq]):
            raise ValueError(f"sequence {seq!r}: {n} more tokens do not fit its pages; reserve first")
        self.lengths[seq] += n

    def truncate(self, seq, length: int) -> None:
        """`seq`'s pages now hold its first `length` slots (decode-time eviction compacted them): the pages
        past them go back to the pool."""
        table, keep = self.tables[seq], self.pages_for(length)
        if keep > len(table):
            raise ValueError(f"sequence {seq!r}: {length} slots do not fit its {len(table)} pages")
        for page in reversed(table[keep:]):
            self._drop(page)
        del table[keep:]
        self.lengths[seq] = length

    def register(self, seq, history) -> None:
        """Enter `seq`'s full pages into the prefix cache, keyed by `history` (its tokens from the start)."""
        key, history = b"", np.asarray(history)
        for i, page in enumerate(self.tables[seq][: min(len(history), self.lengths[seq]) // self.page_size]):
            key = page_hash(key, history[i * self.page_size : (i + 1) * self.page_size])
            if key not in self.cached and page not in self.page_key:
                self.cached[key], self.page_key[page] = page, key

    def fork(self, parent, child) -> None:
        """`child` shares every page of `parent` (parallel sampling, or a test of copy-on-write)."""
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for page in self.tables[child]:
            self.refs[page] += 1

    def release(self, seq) -> None:
        """Drop `seq`'s pages, last first (so its tail pages are reused before its prefix)."""
        for page in reversed(self.tables.pop(seq)):
            self._drop(page)
        del self.lengths[seq]

    def table(self, seqs, width: int) -> np.ndarray:
        """Block tables `[len(seqs), width]` int32, padded with the null page (None: an empty row)."""
        out = np.full((len(seqs), width), NULL_PAGE, np.int32)
        for row, seq in enumerate(seqs):
            if seq is not None:
                pages = self.tables[seq]
                if len(pages) > width:
                    raise ValueError(f"sequence {seq!r} holds {len(pages)} pages; the table has {width} columns")
                out[row, : len(pages)] = pages
        return out

    # --- pages ------------------------------------------------------------------------------------
    def _allocate(self) -> int:
        page, _ = self.free.popitem(last=False)  # least recently freed
        if page in self.page_key:  # an unreferenced cached page is reused: it leaves the prefix cache
            del self.cached[self.page_key.pop(page)]
        self.refs[page] = 1
        return page

    def _take(self, page: int) -> None:
        if self.refs[page] == 0:
            del self.free[page]
        self.refs[page] += 1

    def _drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free[page] = None

"""Decode-time eviction (a policy's `every=N`: H2O, TOVA, SnapKV-style re-selection, Scissorhands, key
norm, StreamingLLM) in the engine's pages, so that a request's memory stays capped at its budget however long
it generates.

It is `Generator`'s decode-time eviction (`kvjax.generate._decode_step`) row by row: each decode step
observes its query's attention over the row's slots (H2O adds it to the running sum each slot keeps in
its page, `PagedKVCache.stat`, Scissorhands its below-average count), and on the row's every N-th step
since its prefill the row's slots are re-selected by the same `compress_caches` the Generator runs, on
the dense view of the row's pages, and compacted in place (`PagedKVCache.compact`): the kept tokens
first, in slot order, as the Generator's dense cache keeps them. A row then holds at most its budget plus
N slots; the host frees the pages past its new length (`PagePool.truncate`). Layers with budgets of their
own (PyramidKV's) share one pool of pages (`kvjax.paged.SharedPool`, threaded through the views and the
compaction in layer order), each layer re-selected down to its own budget
(`kvjax.layer_pages.LayerPages.truncate`); AdaKV's pooled entries (`kvjax.paged_pooled`) are re-selected
as its dense pool is, K x budget entries a row (a ring's, under `local=true`, then sorted oldest first,
`kvjax.paged_pooled.as_ring`, with their sums). Under `local=true` a row's re-selected rings take the
longest one's length (`_share_length`), as the window pool's one length a row needs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.compress.apply import StagePlan, compress_caches, observe_fn
from kvjax.paged import SharedPool
from kvjax.paged_pooled import PagedPooledCache, as_ring


class Eviction(NamedTuple):
    """What the jitted step needs, static (hashable): the last stage's `StagePlan.static` with every
    compressible cache's slots the engine rows' width, and those caches' indices."""

    static: tuple
    slots: tuple[int, ...]

    @classmethod
    def of(cls, plan: StagePlan, width: int, slots: tuple[int, ...], rings=None) -> Eviction:
        """From the last stage's plan for any prompt: `width` tokens a row's view holds (the block table's;
        an AdaKV pool's view holds K entries a token); `rings`: per compressible cache, the tokens of its
        compressed ring (`local=true`), else None."""
        rings = rings or [None] * len(slots)
        caps = tuple((ring or width) * heads for heads, ring in zip(plan.heads, rings))
        return cls(dataclasses.replace(plan, keep_caps=caps, capacities=caps).static, tuple(slots))

    @property
    def caps(self) -> tuple[int, ...]:
        """Per compressible cache, the slots (entries) of the dense view it re-selects."""
        return self.static[1]

    @property
    def rings(self) -> bool:
        """Whether compressed rings (`local=true`, the sliding-window layers' own pool) are re-selected too."""
        return any(self.static[7])

    @property
    def every(self) -> int:
        return self.static[0].every


def budget_row(plan: StagePlan, prompt_length: int) -> np.ndarray:
    """One request's row of `Rows.budgets`: its prompt length, then per compressible cache the tokens kept
    (`counts`), the recent tokens always kept (`windows`) and AdaKV floors (`floors`) of its last stage."""
    return np.concatenate([[prompt_length], plan.counts[:, 0], plan.windows[:, 0], plan.floors[:, 0]]).astype(np.int32)


def evicting_step(model, caches, tokens: jax.Array, pos: jax.Array, budgets: jax.Array, evict: Eviction):
    """One decode token per row (tokens, pos `[R]`, -1: no token) through `caches` (their rows set, no mixed
    chunk), observed; rows at a multiple of `every` decode steps since their prefill are re-selected down
    to their budgets `[R, 1 + 3n]` (`budget_row`). Returns the final hidden states `[R,1,D]` and the caches."""
    stage, slots = evict.static[0], evict.slots
    R, n = tokens.shape[0], len(slots)
    hidden, caches, observed = model.observe(
        tokens[:, None], pos[:, None], caches, jnp.zeros((R, 1), jnp.int32), observe_fn((stage,)), evict.rings
    )
    prompt, counts, windows, floors = budgets[:, 0], *(budgets[:, 1 + i * n : 1 + (i + 1) * n].T for i in range(3))
    due = (pos >= 0) & ((pos - prompt + 1) % stage.every == 0)  # the Generator's step index, from 1
    dense, running, pool = [None] * len(caches), [None] * len(caches), SharedPool()
    for slot, cap in zip(slots, evict.caps):
        cache, seen = pool.enter(slot, caches[slot]), observed[slot]
        pool.leave(cache)  # (read only)
        dense[slot] = cache.dense(cap)
        stat = None if seen is None else seen[0]
        if cache.stat is not None:  # a statistic that adds up over the steps
            stat = stat + cache.stat_view()
        running[slot] = None if stat is None else (stat[..., :cap],)  # (a ring's first slots)

    def reselect(caches):
        new, stats = compress_caches(
            tuple(dense), tuple(running), (evict.static,), ((counts, windows, floors, None),), pos, slots, stage.every
        )
        new, stats = list(new), list(stats)
        for slot in slots:  # an AdaKV ring's entries oldest first, as its pages write over them (`as_ring`)
            if isinstance(caches[slot], PagedPooledCache) and caches[slot].windowed:
                new[slot], stats[slot] = as_ring(new[slot], stats[slot])
        _share_length(new, stats, {slot: getattr(caches[slot], "heads", 1) for slot in slots if caches[slot].windowed})
        caches, pool = list(caches), SharedPool()
        for slot in slots:
            cache = pool.enter(slot, caches[slot]).compact(due, new[slot])
            if cache.stat is not None:  # a row not due keeps its slots, and so its own running sums
                cache = cache.with_stat(jnp.where(due[:, None, None], stats[slot], running[slot][0]), due)
            caches[slot] = pool.leave(cache)
        return tuple(pool.close(caches))

    def keep(caches):  # no row re-selects: only the running sums go back to the pages
        caches, pool = list(caches), SharedPool()
        for slot in slots:
            cache = pool.enter(slot, caches[slot])
            caches[slot] = pool.leave(cache if cache.stat is None else cache.with_stat(running[slot][0]))
        return tuple(pool.close(caches))

    return hidden, jax.lax.cond(due.any(), reselect, keep, caches)


def _share_length(new: list, stats: list, rings: dict[int, int]) -> None:
    """Re-selected rings (`new[slot]` for the window pool's `rings`, slot -> entries a token: K in an AdaKV
    pool, else 1; PyramidKV's keep different numbers of tokens) moved, with their statistics, to the end of
    the longest one's tokens, the slots before them empty, so that a row's rings share the one length that
    pool keeps, as at the load (`engine._aligned`): a ring of C >= W slots then writes over only tokens out
    of every later query's window. In place."""
    if len(rings) < 2:
        return
    tokens = [-(-new[slot].length // unit) for slot, unit in rings.items()]  # (`PagedPooledCache.compact`)
    longest = functools.reduce(jnp.maximum, tokens)
    for slot, unit in rings.items():
        cache, shift = new[slot], longest * unit - new[slot].length
        moved = {name: _rolled(getattr(cache, name), shift, 2) for name in ("k", "v")}
        moved |= {name: _rolled(getattr(cache, name), shift, 1) for name in ("pos", "head") if hasattr(cache, name)}
        new[slot] = cache.replace(**moved, length=longest * unit)
        stats[slot] = None if stats[slot] is None else _rolled(stats[slot], shift, 1)


def _rolled(x: jax.Array, shift: jax.Array, from_end: int) -> jax.Array:
    """Each row b of `x` rolled by shift[b] along its axis `from_end` places from the last (a slot axis)."""
    return jax.vmap(functools.partial(jnp.roll, axis=x.ndim - from_end - 1))(x, shift)

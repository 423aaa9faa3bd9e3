"""Recurrent layers in the engine: a fixed state slot per admitted sequence instead of pages (vLLM's
answer for hybrid models: pages for attention, one constant-size state per request for the rest).

A recurrent layer's state (Mamba's conv inputs and SSM state, RWKV-7's token shifts and WKV state,
retention's S) does not grow with the sequence, so it is not paged: the layer keeps `slots` states, one
per sequence the engine runs at once, and each step's rows say which state is theirs (`rows`, per block
table row). A mixed step (`kvjax.paged`: R decode tokens, one per row, then a prompt chunk of row
`chunk_row`, packed as one sequence) runs the layer twice on the states it gathers: the decode tokens as R
sequences of one token, the chunk as one sequence starting from its row's state (from zeros when the chunk
starts the prompt: a new or recomputed request), and the states go back to their slots. Rows that feed
nothing (position -1) write nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import _Arrays


@struct.dataclass
class SlotStates(_Arrays):
    """`slots` recurrent states of one layer (`state`: its kind's state pytree, leading axis the slot),
    the state slot of each block-table row (`rows`, `[B]`; `slots` where the row has none), the rows'
    lengths (tokens fed, as paged caches count them) and, for a mixed step, the chunk's row."""

    state: object
    rows: jax.Array
    length: jax.Array
    chunk_row: jax.Array | None = None

    @classmethod
    def init(cls, state, table_rows: int) -> SlotStates:
        """Empty states (`state` has one per slot) for an engine of `table_rows` block-table rows."""
        slots = jax.tree.leaves(state)[0].shape[0]
        return cls(state, jnp.full((table_rows,), slots, jnp.int32), jnp.zeros((table_rows,), jnp.int32))

    @property
    def slots(self) -> int:
        return jax.tree.leaves(self.state)[0].shape[0]

    def nbytes(self) -> int:
        """Bytes of the states (what the layer holds for every sequence); the rows are the engine's."""
        return sum(x.nbytes for x in jax.tree.leaves(self.state))

    def _carried(self) -> dict:
        """What a step writes and the engine keeps (as a paged cache's pools): the states."""
        return dict(state=self.state)

    def copy_pages(self, copies) -> SlotStates:
        """States hold no pages: a page copied for a shared prefix (copy-on-write) leaves them as they are."""
        return self

    def load(self, row, state) -> SlotStates:
        """These states with block-table row `row`'s slot set to `state` (one sequence's, leading axis 1: a
        prompt prefilled apart, as the engine's policies prefill whole prompts)."""
        slot = self.rows[row]
        return self.replace(
            state=jax.tree.map(lambda s, n: s.at[slot].set(n[0].astype(s.dtype), mode="drop"), self.state, state)
        )

    def run(self, block, x: jax.Array, positions: jax.Array):
        """`block` (a recurrent layer's block: `block(x, positions, state) -> (x, state, view)`) over a step's
        packed tokens x `[1, R + C, D]`: (its output, these states updated, no view). One token a row as a
        batch, x `[R, 1, D]` (decode-time eviction's observed step, `kvjax.paged_eviction`), runs packed."""
        if x.shape[0] > 1:
            out, states, view = self.run(block, x.reshape(1, -1, x.shape[-1]), positions.reshape(1, -1))
            return out.reshape(x.shape[0], 1, -1), states, view
        R = self.rows.shape[0]
        C = x.shape[1] - R
        fed = positions[0, :R] >= 0
        where = jnp.where(fed, self.rows, self.slots)  # a row that feeds nothing writes nowhere
        mine = jax.tree.map(lambda s: s[jnp.minimum(where, self.slots - 1)], self.state)
        out, new, _ = block(x[0, :R, None], positions[0, :R, None], mine)
        state = jax.tree.map(lambda s, n: s.at[where].set(n.astype(s.dtype), mode="drop"), self.state, new)
        length = self.length + fed
        out = out.reshape(1, R, -1)
        if C > 0:
            slot = self.rows[self.chunk_row]
            start = positions[0, R] == 0  # the chunk begins the prompt: no earlier state is this sequence's
            mine = jax.tree.map(
                lambda s: jnp.where(start, jnp.zeros_like(s[0]), s[jnp.minimum(slot, self.slots - 1)]), state
            )
            chunk, new, _ = block(x[:, R:], positions[:, R:], jax.tree.map(lambda s: s[None], mine))
            state = jax.tree.map(lambda s, n: s.at[slot].set(n[0].astype(s.dtype), mode="drop"), state, new)
            length = length.at[self.chunk_row].add((positions[0, R:] >= 0).sum(dtype=jnp.int32))
            out = jnp.concatenate([out, chunk], axis=1)
        return out, self.replace(state=state, length=length), None

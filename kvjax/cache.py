"""Attention caches: immutable pytrees passed into a layer and returned updated.

Every slot stores its token's position (`pos`, -1 when empty), so masks come from positions alone and a
cache whose slots are evicted, reordered or merged needs no special attention code. Shapes are static:
capacity is fixed at creation, so prefill and decode compile once.

`update(k, v, pos)` writes a chunk of new tokens (token-major `[B,T,K,H]`, as projections produce them)
and returns the updated cache together with the K/V the chunk's queries must attend to (`KVView`,
head-major `[B,K,S,H]` like the stored arrays). New tokens with `pos < 0` are padding: they are never written,
and must come after the valid tokens of their row (prompts are right-padded).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.config import ModelConfig
from kvjax.plan import LayerPlan


class KVView(NamedTuple):
    """What a chunk of queries attends to: keys and values `[B,K,S,H]` and their positions `[B,S]`."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array


def _check_chunk(cache, k, v, pos) -> None:
    B, K, _, H = cache.k.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[2:] != (K, H) or v.shape != k.shape:
        raise ValueError(f"new k {k.shape} / v {v.shape} must be [B={B}, T, K={K}, H={H}] and equal")
    if pos.shape != k.shape[:2]:
        raise ValueError(f"new pos {pos.shape} must be [B, T] = {k.shape[:2]}")


def heads_first(x: jax.Array) -> jax.Array:
    """Token-major `[B,T,K,H]` -> head-major `[B,K,T,H]`, the layout caches and the attention op use."""
    return x.transpose(0, 2, 1, 3)


def _scatter(buf: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Token t of row b goes to slot slots[b, t] (slots outside [0, S) are dropped): for positions
    buf `[B,S]` and values `[B,T]`, or for K/V buf `[B,K,S,H]` and token-major values `[B,T,K,H]`."""
    rows = jnp.arange(buf.shape[0])[:, None]
    index = (rows, slots) if buf.ndim == 2 else (rows, slice(None), slots)
    return buf.at[index].set(values.astype(buf.dtype), mode="drop")


@struct.dataclass
class _SlotCache:
    """Fields and bookkeeping shared by the attention caches; subclasses define where tokens go."""

    k: jax.Array  # [B,K,S,H], head-major (see kvjax.ops)
    v: jax.Array  # [B,K,S,H]
    pos: jax.Array  # [B,S] int32, -1 for an empty slot
    length: jax.Array  # [B] int32, tokens written so far

    @classmethod
    def init(cls, batch: int, capacity: int, n_kv_heads: int, head_dim: int, dtype):
        shape = (batch, n_kv_heads, capacity, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            pos=jnp.full((batch, capacity), -1, jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Exact bytes of every array the cache holds."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))

    def _write(self, slots: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array):
        return self.replace(
            k=_scatter(self.k, slots, k),
            v=_scatter(self.v, slots, v),
            pos=_scatter(self.pos, slots, pos),
            length=self.length + (pos >= 0).sum(axis=1, dtype=jnp.int32),
        )


@struct.dataclass
class KVCache(_SlotCache):
    """Dense cache: each new token goes to its row's next free slot; holds up to capacity S tokens."""

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[KVCache, KVView]:
        _check_chunk(self, k, v, pos)
        slots = self.length[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
        new = self._write(jnp.where(pos >= 0, slots, self.capacity), k, v, pos)
        return new, KVView(new.k, new.v, new.pos)


@struct.dataclass
class RingKVCache(_SlotCache):
    """Sliding-window cache of W slots: position p lives in slot p % W, so memory stays constant.

    A single decode token is written first and then attends over the ring (which then holds exactly the
    last W positions). A longer chunk attends over the old ring plus the whole chunk, since writing first
    could overwrite keys that the chunk's earlier queries still need; then its last W tokens are written.
    """

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[RingKVCache, KVView]:
        _check_chunk(self, k, v, pos)
        W = self.capacity
        newest = jnp.max(pos, axis=1, keepdims=True)
        keep = (pos >= 0) & (pos > newest - W)  # the chunk's last W tokens: distinct slots mod W
        new = self._write(jnp.where(keep, pos % W, W), k, v, pos)
        if k.shape[1] == 1:
            return new, KVView(new.k, new.v, new.pos)
        view = KVView(
            jnp.concatenate([self.k, heads_first(k).astype(self.k.dtype)], axis=2),
            jnp.concatenate([self.v, heads_first(v).astype(self.v.dtype)], axis=2),
            jnp.concatenate([self.pos, pos.astype(jnp.int32)], axis=1),
        )
        return new, view


AttentionCache = KVCache | RingKVCache


def layer_slots(window: int | None, capacity: int) -> int:
    """Slots a layer's cache holds at `capacity` tokens: a sliding window needs at most `window`."""
    return capacity if window is None else min(window, capacity)


def init_caches(cfg: ModelConfig, batch: int, capacity: int) -> tuple[AttentionCache, ...]:
    """Empty caches for every producer layer of the model's plan, in plan order."""
    if batch <= 0 or capacity <= 0:
        raise ValueError(f"batch={batch} and capacity={capacity} must be > 0")
    att = cfg.attention
    dtype = jnp.dtype(cfg.dtype)
    cls = KVCache if att.window is None else RingKVCache
    slots = layer_slots(att.window, capacity)
    return tuple(
        cls.init(batch, slots, att.n_kv_heads, att.head_dim, dtype)
        for _ in LayerPlan.from_config(cfg).producers
    )


def caches_nbytes(caches) -> int:
    return sum(c.nbytes() for c in caches)

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

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct


class KVView(NamedTuple):
    """What a chunk of queries attends to: keys and values `[B,K,S,H]` and their positions `[B,S]` (or
    `[B,K,S]` once heads hold different tokens). A pooled view has k, v `[B,P,H]`, pos `[B,P]` and each
    entry's KV head `head` `[B,P]`. A quantized cache's view also carries its codes (`quant`) for the
    fused decode kernel, a paged cache's its pages and block tables (`paged`) for the paged kernel;
    whatever reads k and v instead lets XLA drop the other. A view with a `reader` attends through its
    `attend(q, q_pos, impl, window)`: DuoAttention's (`kvjax.duo`), retrieval heads over every token and
    streaming heads over sinks and a recent window; a low-rank cache's (`kvjax.quant.lowrank`), a decode
    step in the latent space of the values; a paged engine's mixed step (`kvjax.paged.RowSplit`), decode
    rows and a prefill chunk each over their own pages."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    head: jax.Array | None = None
    quant: object | None = None  # the same K/V as stored codes (`kvjax.quant.QuantizedKV`), if quantized
    fresh: int | None = None  # T when slots [0, T) hold the attending chunk's own tokens, in order, and
    # no other slot holds a token (a chunk written to an empty cache, or no cache): `kvjax.ops.attention`
    # then reads only those slots and skips the key blocks causality hides
    paged: object | None = None  # the same K/V as pages of a pool (`kvjax.paged.PagedKVCache`), if paged
    reader: object | None = None  # attends its own way: its `attend(q, q_pos, impl, window)` replaces the op


def _check_chunk(cache, k, v, pos) -> None:
    B, K, _, H = cache.k.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[2:] != (K, H) or v.shape != k.shape:
        raise ValueError(f"new k {k.shape} / v {v.shape} must be [B={B}, T, K={K}, H={H}] and equal")
    if pos.shape != k.shape[:2]:
        raise ValueError(f"new pos {pos.shape} must be [B, T] = {k.shape[:2]}")


def heads_first(x: jax.Array) -> jax.Array:
    """Token-major `[B,T,K,H]` -> head-major `[B,K,T,H]`, the layout caches and the attention op use."""
    return x.transpose(0, 2, 1, 3)


def _scatter(buf: jax.Array, slots: jax.Array, values: jax.Array, head_major: bool) -> jax.Array:
    """Token t of row b goes to slot slots[b, t] (slots outside [0, S) are dropped): for token-major
    buf `[B,S,...]` and values `[B,T,...]`, or for head-major buf `[B,K,S,...]` and values `[B,T,K,...]`."""
    rows = jnp.arange(buf.shape[0])[:, None]
    index = (rows, slice(None), slots) if head_major else (rows, slots)
    return buf.at[index].set(values.astype(buf.dtype), mode="drop")


def _append_slots(length: jax.Array, pos: jax.Array, capacity: int) -> jax.Array:
    """Slots `[B,T]` of a chunk appended after each row's `length` tokens; padding goes nowhere."""
    slots = length[:, None] + jnp.arange(pos.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(pos >= 0, slots, capacity)


class _Arrays:
    """What every cache and recurrent state shares: its exact size."""

    def nbytes(self) -> int:
        """Exact bytes of every array the cache holds."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))


class _Positioned(_Arrays):
    """What every positioned cache shares: writing a chunk of tokens to given slots."""

    _HEAD_MAJOR: tuple[str, ...] = ()  # payload fields stored `[B,K,S,...]`

    def _slots(self, pos: jax.Array) -> jax.Array:
        """Slots `[B,T]` of a chunk at positions `pos` `[B,T]`: after each row's tokens (a `Ring`'s: over its
        oldest once full)."""
        return _append_slots(self.length, pos, self.capacity)

    def _write_slots(self, slots: jax.Array, pos: jax.Array, **payload: jax.Array):
        """Token t of row b goes to slot slots[b, t] in `pos` and in each named payload array. Per-head
        positions `[B,K,S]` (a head-wise compressed cache) get the token's position in every head."""
        per_head = self.pos.ndim == 3
        pos_values = jnp.broadcast_to(pos[:, :, None], (*pos.shape, self.pos.shape[1])) if per_head else pos
        return self.replace(
            pos=_scatter(self.pos, slots, pos_values, per_head),
            length=self.length + (pos >= 0).sum(axis=1, dtype=jnp.int32),
            **{
                name: _scatter(getattr(self, name), slots, value, name in self._HEAD_MAJOR)
                for name, value in payload.items()
            },
        )


class Ring:
    """What every compressed ring shares (a sliding-window layer's cache compressed under `local=true`, which
    stays within its C slots however long decoding goes on): it is made from the cache it compresses, and
    takes one decode token at a time, written over the oldest token once its C slots are full."""

    @classmethod
    def of(cls, cache):
        """The ring holding `cache`'s slots as they are."""
        return cls(**{f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)})

    @staticmethod
    def one_token(pos: jax.Array) -> None:
        if pos.shape[1] != 1:
            raise ValueError(f"a compressed ring takes one decode token at a time, not {pos.shape[1]}")

    def _slots(self, pos: jax.Array) -> jax.Array:
        """The slot `[B,1]` of a decode token at `pos` `[B,1]`: n % C for the n-th token held (padding: none)."""
        self.one_token(pos)
        return jnp.where(pos >= 0, self.length[:, None] % self.capacity, self.capacity)


@struct.dataclass
class _SlotCache(_Positioned):
    """Fields and bookkeeping shared by the attention caches; subclasses define where tokens go."""

    k: jax.Array  # [B,K,S,H], head-major (see kvjax.ops)
    v: jax.Array  # [B,K,S,H]
    pos: jax.Array  # [B,S] int32, -1 for an empty slot; [B,K,S] after head-wise compression
    length: jax.Array  # [B] int32, slots filled (the next token goes to slot `length`)
    # Known empty (a prefill's caches, `init_caches(fresh=True)`): the first update's view is then
    # marked `fresh`. Static, so prefill and decode compile apart; every update clears it.
    fresh: bool = struct.field(pytree_node=False, default=False, kw_only=True)

    _HEAD_MAJOR = ("k", "v")

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

    def resized(self, capacity: int):
        """The same tokens in `capacity` slots: cut or padded (empty slots) at the end. Only for a cache
        whose tokens are compacted in slots 0..length-1 and fit `capacity` (what the reducers leave)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return self.replace(k=self.k[:, :, :capacity], v=self.v[:, :, :capacity], pos=self.pos[..., :capacity])
        pad = ((0, 0), (0, 0), (0, extra), (0, 0))
        pos_pad = [(0, 0)] * (self.pos.ndim - 1) + [(0, extra)]
        return self.replace(
            k=jnp.pad(self.k, pad), v=jnp.pad(self.v, pad), pos=jnp.pad(self.pos, pos_pad, constant_values=-1)
        )


@struct.dataclass
class KVCache(_SlotCache):
    """Dense cache: each new token goes to its row's next free slot; holds up to capacity S tokens."""

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[KVCache, KVView]:
        _check_chunk(self, k, v, pos)
        new = self._write_slots(self._slots(pos), pos, k=k, v=v)
        return new.replace(fresh=False), KVView(new.k, new.v, new.pos, fresh=k.shape[1] if self.fresh else None)


def quest_bounds(q: jax.Array, page_min: jax.Array, page_max: jax.Array, filled: jax.Array, newest: jax.Array):
    """Quest's score of each page for a decode query q `[B,1,N,H]` (Tang et al. 2024, sec. 3, Algorithm 1):
    the upper bound sum_c max(q_c min_c, q_c max_c) on q.k over the page's keys (key min and max per page
    and KV head `[B,K,P,H]`), the max over the KV head's query group; `[B,K,P]`, the page of the newest
    token (`newest` `[B]`) +inf (always read), pages not `filled` `[B,P]` -inf (never read)."""
    B, _, N, H = q.shape
    K, P = page_min.shape[1:3]
    q_g = q[:, 0].reshape(B, K, 1, N // K, H).astype(jnp.float32)  # [B,K,1,G,H]
    lo = jnp.where(filled[:, None, :, None], page_min, 0).astype(jnp.float32)[:, :, :, None]
    hi = jnp.where(filled[:, None, :, None], page_max, 0).astype(jnp.float32)[:, :, :, None]
    bound = jnp.maximum(q_g * lo, q_g * hi).sum(axis=-1).max(axis=-1)  # [B,K,P]
    is_newest = (jnp.arange(P)[None, :] == newest[:, None])[:, None, :]
    return jnp.where(filled[:, None, :], jnp.where(is_newest, jnp.inf, bound), -jnp.inf)


@struct.dataclass
class QuestKVCache(KVCache):
    """A dense cache that also keeps, per page of `page_size` slots and per KV head, the channel-wise
    min and max of the keys `[B,K,P,H]` (Quest, Tang et al. 2024, arXiv 2406.10774, sec. 3). Nothing
    is evicted: a decode query reads only the `read_pages` pages whose upper bound on q.k is highest
    (`select`), the page holding the newest token always among them (as in the reference code, where
    the budget counts every page read); a budget of at least the cache's pages reads them all."""

    page_min: jax.Array
    page_max: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)
    read_pages: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def from_cache(cls, cache: KVCache, page_size: int, read_pages: int) -> QuestKVCache:
        """Page bounds of an existing (uncompressed, shared-position) cache."""
        B, K, S, H = cache.k.shape
        P = -(-S // page_size)
        pad = ((0, 0), (0, 0), (0, P * page_size - S), (0, 0))
        valid = jnp.pad(cache.pos >= 0, ((0, 0), (0, P * page_size - S)))[:, None, :, None]
        k = jnp.pad(cache.k, pad).reshape(B, K, P, page_size, H)
        valid = valid.reshape(B, 1, P, page_size, 1)
        return cls(
            k=cache.k,
            v=cache.v,
            pos=cache.pos,
            length=cache.length,
            page_min=jnp.where(valid, k, jnp.inf).min(axis=3).astype(cache.k.dtype),
            page_max=jnp.where(valid, k, -jnp.inf).max(axis=3).astype(cache.k.dtype),
            page_size=page_size,
            read_pages=read_pages,
        )

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[QuestKVCache, KVView]:
        _check_chunk(self, k, v, pos)
        slots = self._slots(pos)
        new = self._write_slots(slots, pos, k=k, v=v)
        P = self.page_min.shape[2]
        page = jnp.where(slots < self.capacity, slots // self.page_size, P)
        begun = jnp.where(slots % self.page_size == 0, page, P)  # a page begun again (a ring's) drops its old bounds
        rows = jnp.arange(k.shape[0])[:, None]
        index = (rows, slice(None), page)
        page_min = self.page_min.at[rows, :, begun].set(jnp.inf, mode="drop")
        page_max = self.page_max.at[rows, :, begun].set(-jnp.inf, mode="drop")
        new = new.replace(
            page_min=page_min.at[index].min(k.astype(self.page_min.dtype), mode="drop"),
            page_max=page_max.at[index].max(k.astype(self.page_max.dtype), mode="drop"),
        )
        return new, KVView(new.k, new.v, new.pos)

    def select(self, q: jax.Array, view: KVView, q_pos: jax.Array, window: int | None = None) -> KVView:
        """The view a single decode query `[B,1,N,H]` at `q_pos` `[B,1]` reads: per KV head, the pages
        with the highest upper bound sum_c max(q_c min_c, q_c max_c) (the max over the head's query
        group), and the newest page, gathered into `[B,K,R*page_size,H]` with per-head positions, so
        attention reads those pages only (the bound reads only the per-page min and max). With a
        sliding `window` (a compressed ring), pages wholly out of it are not candidates."""
        B, K, S = *self.k.shape[:2], self.capacity
        P = self.page_min.shape[2]
        filled = jnp.arange(P)[None, :] * self.page_size < self.length[:, None]  # [B,P]
        if window is not None:  # a page is seen while its newest token is in the window
            newest_pos = jnp.pad(self.pos, ((0, 0), (0, P * self.page_size - S)), constant_values=-1)
            newest_pos = newest_pos.reshape(B, P, self.page_size).max(axis=-1)
            filled = filled & (newest_pos > q_pos[:, :1] - window)
        bound = quest_bounds(q, self.page_min, self.page_max, filled, jnp.argmax(self.pos, axis=1) // self.page_size)
        if self.read_pages >= P:  # every page is read: nothing to select
            return view
        _, top = jax.lax.top_k(bound, self.read_pages)
        top = jnp.sort(top, axis=-1)  # [B,K,R] in page order
        ps = self.page_size
        pos = view.pos if view.pos.ndim == 3 else jnp.broadcast_to(view.pos[:, None], (B, K, S))
        pad = P * ps - S

        def pages(x, fill):  # [B,K,S,...] -> the chosen pages [B,K,R*ps,...]
            x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3), constant_values=fill)
            x = x.reshape(B, K, P, ps, *x.shape[3:])
            idx = top.reshape(B, K, -1, *(1,) * (x.ndim - 3))
            return jnp.take_along_axis(x, idx, axis=2).reshape(B, K, -1, *x.shape[4:])

        return KVView(pages(view.k, 0), pages(view.v, 0), pages(pos, -1))


@struct.dataclass
class WindowQuestKVCache(Ring, QuestKVCache):
    """Quest's pages of a sliding-window layer (`local=true`) as a ring: a new token goes to slot n % C, and a
    page it begins again starts its key bounds afresh. While a page is part overwritten it holds the newest
    token, which Quest always reads, so its bounds (of the new tokens only) never decide a selection; with C
    the slots of every page the window touches, whole, the pages read are those of the cache left to grow."""


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
        new = self._write_slots(jnp.where(keep, pos % W, W), pos, k=k, v=v).replace(fresh=False)
        if k.shape[1] == 1:
            return new, KVView(new.k, new.v, new.pos)
        if self.fresh:  # nothing in the old ring: the chunk alone
            return new, KVView(heads_first(k), heads_first(v), pos, fresh=k.shape[1])
        view = KVView(
            jnp.concatenate([self.k, heads_first(k).astype(self.k.dtype)], axis=2),
            jnp.concatenate([self.v, heads_first(v).astype(self.v.dtype)], axis=2),
            jnp.concatenate([self.pos, pos.astype(jnp.int32)], axis=1),
        )
        return new, view


@struct.dataclass
class WindowKVCache(Ring, KVCache):
    """A sliding-window layer's compressed cache (a ring compressed under `local=true`): its kept tokens in
    position order, then each new token in the next slot, and once the C slots are full, over the oldest
    one (slot n % C for the n-th token held). With C at most the window W, the token overwritten is never
    one a later query sees: C held positions up to p leave the oldest at p - C + 1 or before, out of the
    window of query p + 1 when C = W. So decoding stays within C slots however long it goes on, as the
    uncompressed ring stays within W."""


@struct.dataclass
class PooledKVCache(_Positioned):
    """One pool of KV entries per sequence shared by all KV heads, each entry tagged with its head: what
    AdaKV's per-head budgets need to really shrink memory (Feng et al. 2024, arXiv 2407.11550, where a
    flattened variable-length layout does this). Heads keep different numbers of tokens, yet shapes stay
    static: the pool holds P = (sum of head budgets) + headroom entries.

    k, v `[B,P,H]`; pos `[B,P]` (-1 empty); head `[B,P]` int32 (the entry's KV head); length `[B]`
    (entries filled). A new token appends one entry per KV head; attention masks entries of other heads
    (`kvjax.ops.attention` with `k_head`)."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    head: jax.Array
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PooledKVCache, KVView]:
        """Append a chunk k, v `[B,T,K,H]` (pos `[B,T]`, -1 padding): K entries per token, head-major
        within the token."""
        B, T, K, H = k.shape
        if v.shape != k.shape or pos.shape != (B, T) or B != self.k.shape[0] or H != self.k.shape[2]:
            raise ValueError(f"new k {k.shape} / v {v.shape} / pos {pos.shape} must be [B, T, K, H={self.k.shape[2]}]")
        flat_pos = jnp.repeat(pos, K, axis=1)
        slots = jnp.where(flat_pos >= 0, self.length[:, None] + jnp.cumsum(flat_pos >= 0, axis=1) - 1, self.capacity)
        heads = jnp.broadcast_to(jnp.tile(jnp.arange(K, dtype=jnp.int32), T)[None], (B, T * K))
        new = self.replace(
            k=_scatter(self.k, slots, k.reshape(B, T * K, H), False),
            v=_scatter(self.v, slots, v.reshape(B, T * K, H), False),
            pos=_scatter(self.pos, slots, flat_pos, False),
            head=_scatter(self.head, slots, heads, False),
            length=self.length + (flat_pos >= 0).sum(axis=1, dtype=jnp.int32),
        )
        return new, KVView(new.k, new.v, new.pos, new.head)


@struct.dataclass
class WindowPooledKVCache(Ring, PooledKVCache):
    """An AdaKV pool compressed from a sliding-window ring (`local=true`): a new token's K entries go over
    the K oldest (empty ones first), so the pool stays within its C entries. With C at most K x W, no entry
    a later query sees is overwritten: before the token at p + 1 is written, the live entries (positions
    p + 2 - W to p, one per head at most) number at most K (W - 1), so the K oldest are dead or empty."""

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[WindowPooledKVCache, KVView]:
        self.one_token(pos)
        B, _, K, H = k.shape
        if v.shape != k.shape or B != self.k.shape[0] or H != self.k.shape[2]:
            raise ValueError(f"new k {k.shape} / v {v.shape} must be [B, 1, K, H={self.k.shape[2]}]")
        _, oldest = jax.lax.top_k(-self.pos, K)  # [B,K]: the smallest positions, empty entries (-1) first
        slots = jnp.where(pos >= 0, oldest, self.capacity)
        heads = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None], (B, K))
        new = self.replace(
            k=_scatter(self.k, slots, k[:, 0], False),
            v=_scatter(self.v, slots, v[:, 0], False),
            pos=_scatter(self.pos, slots, jnp.broadcast_to(pos, (B, K)), False),
            head=_scatter(self.head, slots, heads, False),
            length=self.length + K * (pos[:, 0] >= 0),
        )
        return new, KVView(new.k, new.v, new.pos, new.head)


AttentionCache = KVCache | QuestKVCache | RingKVCache | PooledKVCache


@struct.dataclass
class SSMState(_Arrays):
    """Mamba's decoding state (Gu and Dao 2023): the last d_conv - 1 conv inputs `[B,K-1,E]` (model dtype)
    and the SSM state h `[B,E,N]` (fp32). Constant size whatever the sequence length."""

    conv: jax.Array
    h: jax.Array

    @classmethod
    def init(cls, batch: int, d_conv: int, d_inner: int, d_state: int, dtype):
        return cls(
            conv=jnp.zeros((batch, d_conv - 1, d_inner), dtype),
            h=jnp.zeros((batch, d_inner, d_state), jnp.float32),
        )


@struct.dataclass
class RWKVState(_Arrays):
    """RWKV-7's decoding state (Peng et al. 2025): the last time-mix and channel-mix inputs `[B,D]` (token
    shift, model dtype) and the WKV state S `[B,N,H,H]` (fp32). Constant size whatever the sequence."""

    att_shift: jax.Array
    ffn_shift: jax.Array
    s: jax.Array

    @classmethod
    def init(cls, batch: int, d_model: int, head_size: int, dtype):
        return cls(
            att_shift=jnp.zeros((batch, d_model), dtype),
            ffn_shift=jnp.zeros((batch, d_model), dtype),
            s=jnp.zeros((batch, d_model // head_size, head_size, head_size), jnp.float32),
        )


@struct.dataclass
class RetentionState(_Arrays):
    """Retention's recurrent state S `[B,N,H,Hv]` (fp32; gated retention, YOCO sec. 2.2.2, and RetNet's,
    whose values are wider): constant size whatever the sequence length, so it holds no positions."""

    s: jax.Array

    @classmethod
    def init(cls, batch: int, n_heads: int, head_dim: int, value_dim: int | None = None):
        return cls(s=jnp.zeros((batch, n_heads, head_dim, value_dim or head_dim), jnp.float32))


class LatentView(NamedTuple):
    """What a chunk of MLA queries attends to: latents `[B,S,Dc]`, rope keys `[B,S,Dr]`, positions `[B,S]`;
    in a paged engine's mixed step, `split` (a `kvjax.paged.RowSplit`) gives each part its own rows."""

    c: jax.Array
    k_rope: jax.Array
    pos: jax.Array
    split: object | None = None


@struct.dataclass
class LatentCache(_Positioned):
    """MLA cache (DeepSeek-V2, sec. 2.1.2): per token only the normalized latent c_KV `[B,S,Dc]` and the
    RoPE key shared by all heads `[B,S,Dr]` (MHA2MLA: one per source KV head, `[B,S,rope_heads*Dr]`),
    plus positions `[B,S]` (-1 empty) and lengths `[B]`."""

    c: jax.Array
    k_rope: jax.Array
    pos: jax.Array
    length: jax.Array

    @classmethod
    def init(cls, batch: int, capacity: int, latent_dim: int, rope_dim: int, dtype):
        return cls(
            c=jnp.zeros((batch, capacity, latent_dim), dtype),
            k_rope=jnp.zeros((batch, capacity, rope_dim), dtype),
            pos=jnp.full((batch, capacity), -1, jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.c.shape[1]

    def update(self, c: jax.Array, k_rope: jax.Array, pos: jax.Array) -> tuple[LatentCache, LatentView]:
        """Append a chunk (c `[B,T,Dc]`, k_rope `[B,T,Dr]`, pos `[B,T]`, -1 for padding)."""
        B, _, Dc = self.c.shape
        if c.shape[::2] != (B, Dc) or k_rope.shape != (*c.shape[:2], self.k_rope.shape[2]) or pos.shape != c.shape[:2]:
            raise ValueError(
                f"new c {c.shape} / k_rope {k_rope.shape} / pos {pos.shape} must be [B={B}, T, Dc={Dc}], "
                f"[B, T, Dr={self.k_rope.shape[2]}] and [B, T]"
            )
        new = self._write_slots(self._slots(pos), pos, c=c, k_rope=k_rope)
        return new, LatentView(new.c, new.k_rope, new.pos)


def layer_slots(window: int | None, capacity: int) -> int:
    """Slots a layer's cache holds at `capacity` tokens: a sliding window needs at most `window`."""
    return capacity if window is None else min(window, capacity)


LayerCache = AttentionCache | LatentCache | RetentionState | SSMState | RWKVState


def caches_nbytes(caches) -> int:
    return sum(c.nbytes() for c in caches)

"""`QuantKVCache`: K/V stored as bit-packed integer codes with their scales (and zero points), plus, for
KIVI, a full-precision residual of the most recent tokens. Attention reads a dequantized view.

The cache is built from parts, and a quantizer (`kvjax/quant/schemes/`, one module each: `int`, `kivi`,
`kvquant`, `gear`) is the set of parts it switches on: codes per token, or per-channel key blocks
through a full-precision residual (`blocked`), value channel groups, exact outliers (largest
magnitudes, or both extremes), keys quantized before RoPE, exact sinks, and a low-rank error term
(the last three optional parts are pytrees of their own, with their bytes: `kvjax/quant/parts.py`).
Nothing here names a quantizer; each scheme's module says what it is and where it deviates.

Slots are the usual ones (token t of a row at slot `length` when written, `pos` per slot, -1 empty),
so positions, masks and eviction work as for `KVCache`. Bytes (`nbytes()`) count codes, scales, zero
points, the residual, positions and counters.

Attention reads either the dequantized K/V of the returned `KVView`, or, for int and KIVI, the codes
themselves (`KVView.quant`, a `QuantizedKV`): the fused Pallas decode kernel
(`pallas_kernels.quant_decode_attention`) dequantizes block by block. Value scales of KIVI are stored
group-major `[B,K,H/Gv,S]` so that a block's scales are rows of that kernel's blocks.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVView, Ring, _append_slots, _Positioned
from kvjax.quant.packing import pack, packed_width, unpack
from kvjax.quant.parts import LowRankError, Outliers, Sinks, scatter_head_major
from kvjax.quant.quantizers import dequantize, quantize
from kvjax.quant.schemes import SCHEMES, Scheme
from kvjax.rope import rotate_slots


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a QuantKVCache encodes K and V: `method` a registered scheme (`SCHEMES`: its parts and the
    code widths it allows), `bits`, `group` (tokens per key group, channels per value group) and
    `residual` (full-precision recent tokens, a multiple of group) of the blocked schemes."""

    method: str
    bits: int
    asym: bool = False  # int: min-max codes with a zero point per token (else symmetric)
    group: int = 32
    residual: int = 128
    outliers: float = 0.01  # kvquant: fraction of each vector kept exactly
    sinks: int = 1  # kvquant: first tokens kept in full precision
    rope_theta: float | None = None  # kvquant: the layer's RoPE base (set from the model config)
    rank: int = 0  # gear: rank of each block's error approximation

    def __post_init__(self):
        if self.method not in SCHEMES:
            raise ValueError(f"quantization method={self.method!r} must be one of {tuple(SCHEMES)}")
        scheme = self.scheme
        if self.rank < 0 or (self.rank and not scheme.low_rank):
            with_rank = tuple(name for name, s in SCHEMES.items() if s.low_rank)
            raise ValueError(
                f"{self.method}: rank={self.rank} must be >= 0, and applies to {', '.join(with_rank)} only"
            )
        if self.asym and not scheme.asym_bits:
            raise ValueError(f"{self.method}: asym=true applies to int only ({self.method} is asymmetric already)")
        allowed = scheme.asym_bits if self.asym else scheme.bits
        if self.bits not in allowed:
            extra = set(scheme.asym_bits) - set(scheme.bits)
            kind = " with asym=true" if self.asym else f" (asym=true also allows {min(extra)})" if extra else ""
            raise ValueError(f"{self.method}: bits={self.bits} must be one of {allowed}{kind}")
        if self.blocked and (self.group < 1 or self.residual < self.group or self.residual % self.group):
            raise ValueError(
                f"{self.method}: residual={self.residual} must be a positive multiple of group={self.group}"
            )
        if not 0 <= self.outliers < 0.5 or self.sinks < 0:
            raise ValueError(f"{self.method}: outliers={self.outliers} must be in [0, 0.5) and sinks={self.sinks} >= 0")

    @property
    def scheme(self) -> Scheme:
        return SCHEMES[self.method]

    @property
    def blocked(self) -> bool:
        """Keys quantized per channel over token groups, through a full-precision residual."""
        return self.scheme.blocked

    def value_group(self, head_dim: int) -> int:
        return min(self.group, head_dim) if self.scheme.value_grouped else head_dim

    def n_outliers(self, head_dim: int) -> int:
        """Exact entries per token vector: the largest magnitudes, or as many largest and smallest."""
        if not self.outliers or self.scheme.outliers is None:
            return 0
        if self.scheme.outliers == "extremes":
            return 2 * math.ceil(self.outliers * head_dim / 2)
        return math.ceil(self.outliers * head_dim)

    def slots(self, capacity: int, ring: bool = False) -> int:
        """Capacity rounded up so key groups tile it; a ring's (`WindowQuantKVCache`) so that GEAR's error
        blocks of `residual` tokens tile it too (a block's slots must not straddle the wrap)."""
        g = self.residual if ring and self.rank else self.group if self.blocked else 1
        return -(-capacity // g) * g


def _scatter_last(buf, slots, values):
    """values `[B,K,T,n]` to slots `[B,T]` of a group-major buf `[B,K,n,S]` (slots outside [0, S) dropped)."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, :, :, slots].set(values.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")


@struct.dataclass
class QuantizedKV:
    """A QuantKVCache's K/V as stored, for attention that dequantizes as it reads
    (`pallas_kernels.quant_decode_partials`): plane-major codes `[B,K,S,H*bits/8]`; key scales (zeros:
    None for symmetric codes) `[B,K,1,S]` per token or `[B,K,S/key_group,H]` per channel; value scales
    `[B,K,H/value_group,S]`; `pos` the positions of the slots held in codes (-1 elsewhere), and KIVI's
    full-precision residual (res_k, res_v `[B,K,R,H]`, res_pos `[B,R]` or `[B,K,R]`) or None."""

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array | None
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array | None
    pos: jax.Array
    res_k: jax.Array | None
    res_v: jax.Array | None
    res_pos: jax.Array | None
    bits: int = struct.field(pytree_node=False)
    key_group: int | None = struct.field(pytree_node=False)  # None: keys scaled per token
    value_group: int = struct.field(pytree_node=False)


@struct.dataclass
class QuantKVCache(_Positioned):
    k_codes: jax.Array  # [B,K,S,H*bits/8] uint8
    v_codes: jax.Array
    k_scale: jax.Array  # int: [B,K,S,1]; kivi: [B,K,S/G,H]
    v_scale: jax.Array  # int: [B,K,S,1]; kivi: [B,K,H/Gv,S]
    k_zero: jax.Array | None  # as the scales; None for symmetric int
    v_zero: jax.Array | None
    k_res: jax.Array | None  # kivi: [B,K,R,H] full precision, the tokens after n_quant
    v_res: jax.Array | None
    pos: jax.Array  # [B,S] (or [B,K,S] after head-wise eviction)
    length: jax.Array  # [B] tokens written
    n_quant: jax.Array  # [B] tokens in codes (kivi: a multiple of residual; int: = length)
    # The scheme's optional parts (kvjax.quant.parts), None when it lacks them. Keys are pre-RoPE in
    # them too when the scheme quantizes keys before RoPE.
    outliers: Outliers | None = None  # exact outlier entries per token vector
    sinks: Sinks | None = None  # the first tokens in full precision
    low_rank: LowRankError | None = None  # GEAR's factors of each block's quantization error
    spec: QuantSpec = struct.field(pytree_node=False, default=None)

    @classmethod
    def init(cls, spec: QuantSpec, batch: int, capacity: int, n_kv_heads: int, head_dim: int, dtype):
        B, K, H, S = batch, n_kv_heads, head_dim, spec.slots(capacity)
        width = packed_width(H, spec.bits)
        zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
        if not spec.blocked:
            zero = (lambda: zeros(B, K, S, 1)) if spec.asym else (lambda: None)  # noqa: E731
            scales = dict(k_scale=zeros(B, K, S, 1), v_scale=zeros(B, K, S, 1), k_zero=zero(), v_zero=zero())
            res = dict(k_res=None, v_res=None)
        else:
            Gv = spec.value_group(H)
            scales = dict(
                k_scale=zeros(B, K, S // spec.group, H),
                k_zero=zeros(B, K, S // spec.group, H),
                v_scale=zeros(B, K, H // Gv, S),
                v_zero=zeros(B, K, H // Gv, S),
            )
            res = dict(k_res=zeros(B, K, spec.residual, H), v_res=zeros(B, K, spec.residual, H))
        if spec.scheme.outliers is not None:
            res["outliers"] = Outliers.init(B, K, S, spec.n_outliers(H), dtype)
        if spec.scheme.exact_sinks:
            res["sinks"] = Sinks.init(B, K, spec.sinks, H, dtype)
        if spec.rank:
            res["low_rank"] = LowRankError.init(B, K, S, H, spec.rank, spec.residual, dtype)
        return cls(
            k_codes=jnp.zeros((B, K, S, width), jnp.uint8),
            v_codes=jnp.zeros((B, K, S, width), jnp.uint8),
            **scales,
            **res,
            pos=jnp.full((B, S), -1, jnp.int32),
            length=jnp.zeros((B,), jnp.int32),
            n_quant=jnp.zeros((B,), jnp.int32),
            spec=spec,
        )

    @classmethod
    def from_cache(cls, cache, spec: QuantSpec, capacity: int) -> QuantKVCache:
        """Quantize a dense cache's tokens (slots 0..length-1, compacted) into a cache of `capacity`
        slots, keeping its positions (shared or per head)."""
        cache = cache.resized(spec.slots(capacity))
        B, K, S, H = cache.k.shape
        new = cls.init(spec, B, capacity, K, H, cache.k.dtype)
        slot = jnp.arange(S, dtype=jnp.int32)[None, :]
        k = cache.k
        if spec.scheme.pre_rope_keys:  # un-rotate at the true positions (shared or per head)
            k = rotate_slots(k, -cache.pos, spec.rope_theta)
        new = new._append(k, cache.v, jnp.where(slot < cache.length[:, None], slot, -1))
        return new.replace(pos=cache.pos)

    @property
    def capacity(self) -> int:
        return self.k_codes.shape[2]

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[QuantKVCache, KVView]:
        """Append a chunk k, v `[B,T,K,H]` (pos `[B,T]`, -1 padding after the valid tokens)."""
        B, T, K, H = k.shape
        if v.shape != k.shape or pos.shape != (B, T) or self.k_codes.shape[:2] != (B, K):
            raise ValueError(f"new k {k.shape} / v {v.shape} / pos {pos.shape} do not fit this cache")
        k_hm, v_hm = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,K,T,H]
        if self.spec.scheme.pre_rope_keys:
            k_hm = rotate_slots(k_hm, -pos, self.spec.rope_theta)
        new = self._append(k_hm, v_hm, pos)
        k_view, v_view = new.dequantized()
        return new, KVView(k_view.astype(k.dtype), v_view.astype(v.dtype), new.pos, quant=new.stored())

    def stored(self) -> QuantizedKV | None:
        """The codes as `QuantizedKV` (a plain scheme: int, KIVI); None when outliers, sinks, RoPE
        re-rotation or low-rank terms (KVQuant, GEAR) are parts, which only the dequantized view applies."""
        spec = self.spec
        if not spec.scheme.plain:
            return None
        slot = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        in_codes = self._held(slot) < self.n_quant[:, None]
        pos = jnp.where(in_codes if self.pos.ndim == 2 else in_codes[:, None], self.pos, -1)
        if not spec.blocked:
            B, K, S, _ = self.k_scale.shape
            per_token = lambda x: None if x is None else x.reshape(B, K, 1, S)  # noqa: E731  ([B,K,S,1]: a free reshape)
            return QuantizedKV(
                self.k_codes,
                per_token(self.k_scale),
                per_token(self.k_zero),
                self.v_codes,
                per_token(self.v_scale),
                per_token(self.v_zero),
                pos,
                None,
                None,
                None,
                bits=spec.bits,
                key_group=None,
                value_group=self.head_dim,
            )
        R = spec.residual
        at = self.n_quant[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # residual token i
        live = at < self.length[:, None]
        at = jnp.minimum(self._ring(at), self.capacity - 1)  # its slot
        if self.pos.ndim == 2:
            res_pos = jnp.where(live, jnp.take_along_axis(self.pos, at, axis=1), -1)
        else:
            res_pos = jnp.where(live[:, None], jnp.take_along_axis(self.pos, at[:, None], axis=2), -1)
        return QuantizedKV(
            self.k_codes,
            self.k_scale,
            self.k_zero,
            self.v_codes,
            self.v_scale,
            self.v_zero,
            pos,
            self.k_res,
            self.v_res,
            res_pos,
            bits=spec.bits,
            key_group=spec.group,
            value_group=spec.value_group(self.head_dim),
        )

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[-1] * 8 // self.spec.bits

    def _ring(self, index: jax.Array) -> jax.Array:
        """The slot of the index-th token held (`WindowQuantKVCache`: a ring)."""
        return index

    def _held(self, slot: jax.Array) -> jax.Array:
        """The index of the token slot `slot` `[1,S]` holds (past each row's length where it holds none)."""
        return slot

    def _append(self, k_hm, v_hm, pos):
        """Write head-major k, v `[B,K,T,H]` (pre-RoPE keys with `pre_rope_keys`) at positions `[B,T]`."""
        slots = self._slots(pos)
        new = self._write_slots(slots, pos)
        if not self.spec.blocked:
            return new._store(slots, k_hm, v_hm, self.spec.bits).replace(n_quant=new.length)
        if new.sinks is not None:  # the first tokens held (their index, which is their slot but in a ring), exactly
            new = new.replace(sinks=new.sinks.write(_append_slots(self.length, pos, self.spec.sinks), k_hm, v_hm))
        return new._kivi_append(k_hm, v_hm, (pos >= 0).sum(axis=1, dtype=jnp.int32))

    def _store(self, slots, k_hm, v_hm, bits):
        """Per-token codes of k, v `[B,K,T,H]` (symmetric, or min-max with `asym`) written to slots `[B,T]`."""
        sym = not self.spec.asym
        kc, ks, kz = quantize(k_hm, bits, k_hm.shape[-1], symmetric=sym)
        vc, vs, vz = quantize(v_hm, bits, v_hm.shape[-1], symmetric=sym)
        zeros = (
            {}
            if sym
            else dict(
                k_zero=scatter_head_major(self.k_zero, slots, kz), v_zero=scatter_head_major(self.v_zero, slots, vz)
            )
        )
        return self.replace(
            k_codes=scatter_head_major(self.k_codes, slots, pack(kc, bits)),
            v_codes=scatter_head_major(self.v_codes, slots, pack(vc, bits)),
            k_scale=scatter_head_major(self.k_scale, slots, ks),
            v_scale=scatter_head_major(self.v_scale, slots, vs),
            **zeros,
        )

    def _kivi_append(self, k_hm, v_hm, added):
        """KIVI: new tokens join the residual; every full block of `residual` tokens is quantized (keys
        per channel over `group` tokens, values per token over channel groups) and leaves it."""
        spec, T, H = self.spec, k_hm.shape[2], k_hm.shape[3]
        R, G, Gv = spec.residual, spec.group, spec.value_group(H)
        n_res = self.length - added - self.n_quant  # residual tokens before this chunk
        W = -(-(R + T) // G) * G
        # Work buffer: the residual's tokens, then the chunk's, contiguous; index i is token n_quant + i.
        at = n_res[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        at = jnp.where(jnp.arange(T)[None, :] < added[:, None], at, W)
        work_k = scatter_head_major(jnp.pad(self.k_res, ((0, 0), (0, 0), (0, W - R), (0, 0))), at, k_hm)
        work_v = scatter_head_major(jnp.pad(self.v_res, ((0, 0), (0, 0), (0, W - R), (0, 0))), at, v_hm)
        total = n_res + added
        flush = total // R * R
        i = jnp.arange(W, dtype=jnp.int32)[None, :]
        slots = jnp.where(i < flush[:, None], self._ring(self.n_quant[:, None] + i), self.capacity)
        dense_k, dense_v, extra, chunk_outliers = work_k, work_v, {}, None
        if spec.n_outliers(H):  # dense and sparse: each vector's outliers stay exact, out of the range
            dense_k, dense_v, chunk_outliers = Outliers.taken_from(
                work_k, work_v, spec.n_outliers(H), spec.scheme.outliers == "extremes"
            )
            extra["outliers"] = self.outliers.written(slots, chunk_outliers)
        # Keys: per channel over groups of G tokens; values: per token over groups of Gv channels.
        kc, ks, kz = quantize(dense_k.swapaxes(2, 3), spec.bits, G, symmetric=False)  # [B,K,H,W], [B,K,H,W/G]
        vc, vs, vz = quantize(dense_v, spec.bits, Gv, symmetric=False)
        groups = jnp.arange(W // G, dtype=jnp.int32)[None, :]
        first = self._ring(self.n_quant[:, None] + groups * G)  # each group's first slot (groups tile a ring)
        gslots = jnp.where((groups + 1) * G <= flush[:, None], first // G, self.capacity)
        keep = flush[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # what stays in the residual
        take = lambda w: jnp.take_along_axis(w, jnp.minimum(keep, W - 1)[:, None, :, None], axis=2)  # noqa: E731
        live = (jnp.arange(R)[None, :] < (total - flush)[:, None])[:, None, :, None]
        if self.low_rank is not None:  # GEAR: a low-rank approximation of each flushed block's error
            recon_k = dequantize(kc, ks, kz, spec.bits, G).swapaxes(2, 3)
            recon_v = dequantize(vc, vs, vz, spec.bits, Gv)
            if chunk_outliers is not None:
                recon_k, recon_v = chunk_outliers.apply(recon_k, recon_v)
            blocks = jnp.arange(-(-W // R), dtype=jnp.int32)[None, :]
            bslots = self._ring(self.n_quant[:, None] + blocks * R) // R  # each block's (error blocks tile a ring)
            bslots = jnp.where((blocks + 1) * R <= flush[:, None], bslots, self.low_rank.k_p.shape[2])
            extra["low_rank"] = self.low_rank.write(work_k, work_v, recon_k, recon_v, slots, bslots)
        return self.replace(
            k_codes=scatter_head_major(self.k_codes, slots, pack(kc.swapaxes(2, 3), spec.bits)),
            v_codes=scatter_head_major(self.v_codes, slots, pack(vc, spec.bits)),
            k_scale=scatter_head_major(self.k_scale, gslots, ks.swapaxes(2, 3)),
            k_zero=scatter_head_major(self.k_zero, gslots, kz.swapaxes(2, 3)),
            v_scale=_scatter_last(self.v_scale, slots, vs),
            v_zero=_scatter_last(self.v_zero, slots, vz),
            k_res=jnp.where(live, take(work_k), 0).astype(self.k_res.dtype),
            v_res=jnp.where(live, take(work_v), 0).astype(self.v_res.dtype),
            n_quant=self.n_quant + flush,
            **extra,
        )

    def dequantized(self) -> tuple[jax.Array, jax.Array]:
        """Full-precision K, V `[B,K,S,H]` (fp32): codes dequantized, the residual at its slots."""
        spec = self.spec
        kc, vc = unpack(self.k_codes, spec.bits), unpack(self.v_codes, spec.bits)
        H = kc.shape[-1]
        if not spec.blocked:
            return (
                dequantize(kc, self.k_scale, self.k_zero, spec.bits, H),
                dequantize(vc, self.v_scale, self.v_zero, spec.bits, H),
            )
        k = dequantize(
            kc.swapaxes(2, 3), self.k_scale.swapaxes(2, 3), self.k_zero.swapaxes(2, 3), spec.bits, spec.group
        )
        k = k.swapaxes(2, 3)
        v = dequantize(vc, self.v_scale.swapaxes(2, 3), self.v_zero.swapaxes(2, 3), spec.bits, spec.value_group(H))
        for part in (self.low_rank, self.outliers):  # error terms, exact entries
            if part is not None:
                k, v = part.apply(k, v)
        if self.sinks is not None:  # exact tokens, in the slots that still hold them
            n = min(self.sinks.k.shape[2], self.capacity)
            held = self._held(jnp.arange(n, dtype=jnp.int32)[None, :]) < self.sinks.k.shape[2]
            k, v = self.sinks.apply(k, v, held)
        R = spec.residual
        at = self.n_quant[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]
        at = jnp.where(at < self.length[:, None], self._ring(at), self.capacity)
        k, v = scatter_head_major(k, at, self.k_res), scatter_head_major(v, at, self.v_res)
        if spec.scheme.pre_rope_keys:  # RoPE at each slot's true position
            k = rotate_slots(k, self.pos, spec.rope_theta)
        return k, v


@struct.dataclass
class WindowQuantKVCache(Ring, QuantKVCache):
    """A sliding-window layer's ring compressed under `local=true` into the codes of a plain scheme (int,
    KIVI): as `kvjax.cache.WindowKVCache`, its kept tokens in position order, then each new token in the
    next slot and, once its C slots are full, over the oldest (slot n % C for the n-th token held), which
    no later query sees. Per-token codes are their slot's alone; KIVI's blocks are quantized as the cache
    left to grow quantizes them (the same R tokens, keys per channel over groups of G) and written to
    their tokens' slots, which tile the ring by whole groups (C a multiple of G), its residual read at its
    tokens' slots too. So the ring decodes as the cache left to grow does, in at most the window's slots
    (rounded up to whole key groups)."""

    def _ring(self, index: jax.Array) -> jax.Array:
        return index % self.capacity

    def _held(self, slot: jax.Array) -> jax.Array:
        """The newest token index n < length with n % C == slot."""
        C = self.capacity
        return slot + jnp.maximum(self.length[:, None] - 1 - slot, 0) // C * C


def rings_codes(spec: QuantSpec) -> bool:
    """Whether `spec`'s codes can ring (`WindowQuantKVCache`): a plain scheme's (int's per token, KIVI's
    blocks and residual), with no other part."""
    return spec.scheme.plain

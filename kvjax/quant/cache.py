"""`QuantKVCache`: K/V stored as bit-packed integer codes with their scales (and zero points), plus, for
KIVI, a full-precision residual of the most recent tokens. Attention reads a dequantized view.

The cache is built from parts, and a quantizer (`kvjax/quant/schemes/`, one module each: `int`, `kivi`,
`kvquant`, `gear`) is the set of parts it switches on: codes per token, or per-channel key blocks
through a full-precision residual (`blocked`), value channel groups, exact outliers (largest
magnitudes, or both extremes), keys quantized before RoPE, exact sinks, and a low-rank error term.
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

from kvjax.cache import KVView, _append_slots, _Positioned, _scatter
from kvjax.quant.packing import pack, packed_width, unpack
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

    def slots(self, capacity: int) -> int:
        """Capacity rounded up so key groups tile it."""
        g = self.group if self.blocked else 1
        return -(-capacity // g) * g


def _head_major_scatter(buf, slots, values):
    """values `[B,K,T,...]` to slots `[B,T]` of buf `[B,K,S,...]` (slots outside [0, S) dropped)."""
    return _scatter(buf, slots, jnp.moveaxis(values, 1, 2), head_major=True)


def _scatter_last(buf, slots, values):
    """values `[B,K,T,n]` to slots `[B,T]` of a group-major buf `[B,K,n,S]` (slots outside [0, S) dropped)."""
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, :, :, slots].set(values.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")


def _split_outliers(x, n: int, extremes: bool = False):
    """x `[..., H]` -> (x with each vector's n outliers replaced, their values, their channels). KVQuant:
    the n largest magnitudes, zeroed; GEAR (`extremes`): the n/2 largest and n/2 smallest entries, set
    to the vector's mean."""
    f = x.astype(jnp.float32)
    if extremes:
        idx = jnp.concatenate([jax.lax.top_k(f, n // 2)[1], jax.lax.top_k(-f, n // 2)[1]], axis=-1)
        fill = jnp.broadcast_to(f.mean(axis=-1, keepdims=True), idx.shape).astype(x.dtype)
    else:
        idx = jax.lax.top_k(jnp.abs(f), n)[1]
        fill = jnp.zeros(idx.shape, x.dtype)
    values = jnp.take_along_axis(x, idx, axis=-1)
    return jnp.put_along_axis(x, idx, fill, axis=-1, inplace=False), values, idx.astype(jnp.uint8)


def _restore(x: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """x `[..., H]` with each vector's exact outliers (values at channels idx `[..., n]`) written back:
    one select per outlier, which XLA fuses into the dequantization (a scatter would not fuse)."""
    channel = jnp.arange(x.shape[-1], dtype=jnp.int32).reshape((1,) * (x.ndim - 1) + (-1,))
    for j in range(idx.shape[-1]):
        x = jnp.where(channel == idx[..., j : j + 1].astype(jnp.int32), values[..., j : j + 1].astype(x.dtype), x)
    return x


def low_rank(error: jax.Array, rank: int, loops: int = 3) -> tuple[jax.Array, jax.Array]:
    """GEAR's power iteration (`fake_poweriteration_group`): Q `[..., T, r]` and P `[..., H, r]` with
    Q P^T ~ error `[..., T, H]`; P starts from a fixed U[0, 1) draw, QR only on the last pass."""
    e = error.astype(jnp.float32)
    p = jnp.broadcast_to(jax.random.uniform(jax.random.key(0), (e.shape[-1], rank)), (*e.shape[:-2], e.shape[-1], rank))
    for i in range(loops):
        last = i == loops - 1
        if last:
            p = jnp.linalg.qr(p)[0]
        q = e @ p
        if last:
            q = jnp.linalg.qr(q)[0]
        p = e.swapaxes(-1, -2) @ q
    return q, p


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
    k_out: jax.Array | None = None  # kvquant: exact outliers [B,K,S,n] (pre-RoPE keys) and channels
    k_out_idx: jax.Array | None = None
    v_out: jax.Array | None = None
    v_out_idx: jax.Array | None = None
    k_sink: jax.Array | None = None  # kvquant: the first tokens in full precision [B,K,sinks,H] (pre-RoPE)
    v_sink: jax.Array | None = None
    k_lr_q: jax.Array | None = None  # gear: the error's factors, Q per token [B,K,S,r] and P per block
    k_lr_p: jax.Array | None = None  # [B,K,ceil(S/residual),H,r]
    v_lr_q: jax.Array | None = None
    v_lr_p: jax.Array | None = None
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
            n = spec.n_outliers(H)
            res |= dict(
                k_out=zeros(B, K, S, n),
                v_out=zeros(B, K, S, n),
                k_out_idx=jnp.zeros((B, K, S, n), jnp.uint8),
                v_out_idx=jnp.zeros((B, K, S, n), jnp.uint8),
            )
        if spec.scheme.exact_sinks:
            res |= dict(k_sink=zeros(B, K, spec.sinks, H), v_sink=zeros(B, K, spec.sinks, H))
        if spec.rank:
            r, blocks = spec.rank, -(-S // spec.residual)
            res |= dict(
                k_lr_q=zeros(B, K, S, r),
                v_lr_q=zeros(B, K, S, r),
                k_lr_p=zeros(B, K, blocks, H, r),
                v_lr_p=zeros(B, K, blocks, H, r),
            )
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
        in_codes = slot < self.n_quant[:, None]
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
        at = self.n_quant[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # residual token i's slot
        live = at < self.length[:, None]
        at = jnp.minimum(at, self.capacity - 1)
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

    def _append(self, k_hm, v_hm, pos):
        """Write head-major k, v `[B,K,T,H]` (pre-RoPE keys with `pre_rope_keys`) at positions `[B,T]`."""
        slots = _append_slots(self.length, pos, self.capacity)
        new = self._write_slots(slots, pos)
        if not self.spec.blocked:
            return new._store(slots, k_hm, v_hm, self.spec.bits).replace(n_quant=new.length)
        if self.spec.scheme.exact_sinks:  # the first slots, kept exactly
            new = new.replace(
                k_sink=_head_major_scatter(new.k_sink, slots, k_hm), v_sink=_head_major_scatter(new.v_sink, slots, v_hm)
            )
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
                k_zero=_head_major_scatter(self.k_zero, slots, kz), v_zero=_head_major_scatter(self.v_zero, slots, vz)
            )
        )
        return self.replace(
            k_codes=_head_major_scatter(self.k_codes, slots, pack(kc, bits)),
            v_codes=_head_major_scatter(self.v_codes, slots, pack(vc, bits)),
            k_scale=_head_major_scatter(self.k_scale, slots, ks),
            v_scale=_head_major_scatter(self.v_scale, slots, vs),
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
        work_k = _head_major_scatter(jnp.pad(self.k_res, ((0, 0), (0, 0), (0, W - R), (0, 0))), at, k_hm)
        work_v = _head_major_scatter(jnp.pad(self.v_res, ((0, 0), (0, 0), (0, W - R), (0, 0))), at, v_hm)
        total = n_res + added
        flush = total // R * R
        i = jnp.arange(W, dtype=jnp.int32)[None, :]
        slots = jnp.where(i < flush[:, None], self.n_quant[:, None] + i, self.capacity)
        dense_k, dense_v, extra = work_k, work_v, {}
        n_out = spec.n_outliers(H)
        if n_out:  # dense and sparse: each vector's outliers stay exact, out of the range
            extremes = spec.scheme.outliers == "extremes"
            (dense_k, k_out, k_idx), (dense_v, v_out, v_idx) = (
                _split_outliers(work_k, n_out, extremes),
                _split_outliers(work_v, n_out, extremes),
            )
            extra = dict(
                k_out=_head_major_scatter(self.k_out, slots, k_out),
                k_out_idx=_head_major_scatter(self.k_out_idx, slots, k_idx),
                v_out=_head_major_scatter(self.v_out, slots, v_out),
                v_out_idx=_head_major_scatter(self.v_out_idx, slots, v_idx),
            )
        # Keys: per channel over groups of G tokens; values: per token over groups of Gv channels.
        kc, ks, kz = quantize(dense_k.swapaxes(2, 3), spec.bits, G, symmetric=False)  # [B,K,H,W], [B,K,H,W/G]
        vc, vs, vz = quantize(dense_v, spec.bits, Gv, symmetric=False)
        groups = jnp.arange(W // G, dtype=jnp.int32)[None, :]
        gslots = jnp.where((groups + 1) * G <= flush[:, None], self.n_quant[:, None] // G + groups, self.capacity)
        keep = flush[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # what stays in the residual
        take = lambda w: jnp.take_along_axis(w, jnp.minimum(keep, W - 1)[:, None, :, None], axis=2)  # noqa: E731
        live = (jnp.arange(R)[None, :] < (total - flush)[:, None])[:, None, :, None]
        if spec.rank:  # GEAR: a low-rank approximation of each flushed block's quantization error
            recon_k = dequantize(kc, ks, kz, spec.bits, G).swapaxes(2, 3)
            recon_v = dequantize(vc, vs, vz, spec.bits, Gv)
            if n_out:
                recon_k, recon_v = _restore(recon_k, k_idx, k_out), _restore(recon_v, v_idx, v_out)
            blocks = jnp.arange(-(-W // R), dtype=jnp.int32)[None, :]
            bslots = jnp.where(
                (blocks + 1) * R <= flush[:, None], self.n_quant[:, None] // R + blocks, self.k_lr_p.shape[2]
            )
            extra |= self._low_rank("k", work_k, recon_k, slots, bslots) | self._low_rank(
                "v", work_v, recon_v, slots, bslots
            )
        return self.replace(
            k_codes=_head_major_scatter(self.k_codes, slots, pack(kc.swapaxes(2, 3), spec.bits)),
            v_codes=_head_major_scatter(self.v_codes, slots, pack(vc, spec.bits)),
            k_scale=_head_major_scatter(self.k_scale, gslots, ks.swapaxes(2, 3)),
            k_zero=_head_major_scatter(self.k_zero, gslots, kz.swapaxes(2, 3)),
            v_scale=_scatter_last(self.v_scale, slots, vs),
            v_zero=_scatter_last(self.v_zero, slots, vz),
            k_res=jnp.where(live, take(work_k), 0).astype(self.k_res.dtype),
            v_res=jnp.where(live, take(work_v), 0).astype(self.v_res.dtype),
            n_quant=self.n_quant + flush,
            **extra,
        )

    def _low_rank(self, name, work, recon, slots, bslots) -> dict:
        """GEAR: factors of (work - recon) per block of `residual` tokens, Q written to the tokens' slots,
        P to the blocks' slots."""
        R, (B, K, W, H) = self.spec.residual, work.shape
        Wr = -(-W // R) * R
        error = jnp.pad(work.astype(jnp.float32) - recon, ((0, 0), (0, 0), (0, Wr - W), (0, 0)))
        q, p = low_rank(error.reshape(B, K, Wr // R, R, H), self.spec.rank)
        q = q.reshape(B, K, Wr, -1)[:, :, :W]
        return {
            f"{name}_lr_q": _head_major_scatter(getattr(self, f"{name}_lr_q"), slots, q),
            f"{name}_lr_p": _head_major_scatter(getattr(self, f"{name}_lr_p"), bslots, p),
        }

    def _error(self, q: jax.Array, p: jax.Array) -> jax.Array:
        """GEAR's error approximation `[B,K,S,H]`: each slot's Q `[B,K,S,r]` times its block's P
        `[B,K,S/residual,H,r]` (slots padded to whole blocks, never P repeated per slot)."""
        (B, K, S, r), (n_blocks, H) = q.shape, p.shape[2:4]
        R = self.spec.residual
        q = jnp.pad(q, ((0, 0), (0, 0), (0, n_blocks * R - S), (0, 0))).reshape(B, K, n_blocks, R, r)
        return jnp.einsum("BKCRr,BKCHr->BKCRH", q, p).reshape(B, K, n_blocks * R, H)[:, :, :S]

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
        if spec.rank:  # GEAR's low-rank error terms, Q of each slot times P of its block
            k, v = k + self._error(self.k_lr_q, self.k_lr_p), v + self._error(self.v_lr_q, self.v_lr_p)
        if spec.n_outliers(H):
            k, v = _restore(k, self.k_out_idx, self.k_out), _restore(v, self.v_out_idx, self.v_out)
        if spec.scheme.exact_sinks:
            n = min(spec.sinks, self.capacity)
            k = k.at[:, :, :n].set(self.k_sink[:, :, :n].astype(k.dtype))
            v = v.at[:, :, :n].set(self.v_sink[:, :, :n].astype(v.dtype))
        R = spec.residual
        at = self.n_quant[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]
        at = jnp.where(at < self.length[:, None], at, self.capacity)
        k, v = _head_major_scatter(k, at, self.k_res), _head_major_scatter(v, at, self.v_res)
        if spec.scheme.pre_rope_keys:  # RoPE at each slot's true position
            k = rotate_slots(k, self.pos, spec.rope_theta)
        return k, v

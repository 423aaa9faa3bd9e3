"""KIVI in pages (Liu et al. 2024, arXiv 2402.02750, sec. 3-4; `kvjax/quant/schemes/kivi.py` says what the
scheme keeps): pages hold only quantized tokens, keys per channel over groups of `group` tokens, values
per token over channel groups, as `QuantKVCache` quantizes them; each running sequence's most recent
tokens wait in a full-precision residual of `residual` slots beside the pages, one per sequence slot (as
`kvjax.slot_states` holds a recurrent state), and whenever a decode step fills it the block is quantized
into the pages that already hold those slots in its block table.

So a sequence of L tokens has (L // residual) * residual tokens in codes and the rest in its residual, at
every step exactly as `QuantKVCache` has them: the same codes, scales and zero points from the same
`quantize` calls on the same blocks, so each request decodes as `Generator` decodes it alone. A page
holds `page_size` token slots, a multiple of `group` (a key group never spans two pages) that divides
`residual` (a flush fills whole pages). The host counts slots as for any page (`kvjax.page_pool`): the
pages past a sequence's codes are reserved for its residual's block before they are written.

A step feeds one token per decode row (`chunk_row` set, no prompt chunk): prompts are compressed whole by
the Generator and loaded (`load_quant`), and the tokens a preempted request had generated are re-fed one
decode step each (`Work.stepwise`), so the residual flushes where it did.

KVQuant's blocks (Hooper et al. 2024, sec. 3.3-3.5; `kvjax/quant/schemes/kvquant.py`) are KIVI's with
parts: keys held before RoPE (a decode token's rotated back at its position, the view's rotated again at
each slot's), each token vector's largest entries exact beside its codes (`k_out`, `v_out` and their
channels, per slot in the pages) and the first `sinks` tokens a sequence holds exact in its sequence slot
(`k_sink`, `v_sink`, beside the residual), as `QuantKVCache`'s `Outliers` and `Sinks` parts hold them.

In a sliding-window layer's own pool (`local=true`: the window compressed, then quantized, into
`WindowQuantKVCache`'s ring) a row's C ring slots hold its last C tokens in codes, each flushed block at
its tokens' slots n % C (`PagedKVCache.ring`), over codes no later query sees; the residual stays apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVView
from kvjax.paged import PagedKVCache, RowSplit, _slot_major
from kvjax.quant.cache import QuantKVCache, QuantSpec
from kvjax.quant.packing import pack, packed_width, unpack
from kvjax.quant.parts import LowRankError, Outliers, block_error_factors
from kvjax.quant.quantizers import dequantize, quantize
from kvjax.rope import rotate_slots

_OUTLIERS = dict(k="k_out", k_idx="k_out_idx", v="v_out", v_idx="v_out_idx")  # `Outliers` field -> page array
_LOW_RANK = dict(k_q="k_lr_q", k_p="k_lr_p", v_q="v_lr_q", v_p="v_lr_p")  # `LowRankError` field -> page array


def check_kivi_pages(spec: QuantSpec, page_size: int) -> str | None:
    """Why pages of `page_size` slots cannot hold `spec`'s KIVI codes (None: they can)."""
    G, R = spec.group, spec.residual
    if spec.rank and page_size != R:
        return (
            f"gear pages hold one residual block each, with its low-rank error factors: page_size must equal "
            f"the residual ({R}), not {page_size}"
        )
    if page_size % G or R % page_size:
        sizes = [s for s in range(G, R + 1, G) if R % s == 0]
        return (
            f"{spec.scheme.name} pages need a page_size that is a multiple of the key group ({G}) and divides the "
            f"residual ({R}): one of {sizes}, not {page_size}"
        )
    return None


@struct.dataclass
class PagedKiviCache(PagedKVCache):
    """One layer's KIVI pages: packed codes k, v `[P,K,page_size,H*bits/8]`, key scales and zero points
    k_scale, k_zero `[P,K,page_size/group,H]` (a row per key group), value ones v_scale, v_zero
    `[P,K,page_size,H/Gv]`, positions `[P,1,page_size]`; per sequence slot a residual k_res, v_res
    `[S,K,residual,H]` (full precision) with its positions res_pos `[S,residual]`, and `res_rows` `[B]`:
    each table row's residual slot (S for an empty row)."""

    k_zero: jax.Array | None = None
    v_zero: jax.Array | None = None
    k_res: jax.Array | None = None
    v_res: jax.Array | None = None
    res_pos: jax.Array | None = None
    res_rows: jax.Array | None = None
    k_out: jax.Array | None = None  # KVQuant's exact outliers per slot `[P,K,page_size,n]`: values,
    k_out_idx: jax.Array | None = None  # and their channels (uint8)
    v_out: jax.Array | None = None
    v_out_idx: jax.Array | None = None
    k_sink: jax.Array | None = None  # KVQuant's first `sinks` tokens per sequence slot `[S,K,sinks,H]`, exact
    v_sink: jax.Array | None = None
    k_lr_q: jax.Array | None = None  # GEAR's error factors: Q per slot `[P,K,page_size,r]` and, a page being
    k_lr_p: jax.Array | None = None  # one block, P per page `[P,K,H,r]`
    v_lr_q: jax.Array | None = None
    v_lr_p: jax.Array | None = None
    spec: QuantSpec | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def init_kivi(
        cls, spec: QuantSpec, n_pages: int, page_size: int, batch: int, max_pages: int, K: int, H: int, dtype
    ):
        if why := check_kivi_pages(spec, page_size):
            raise ValueError(why)
        G, Gv, R, w = spec.group, spec.value_group(H), spec.residual, packed_width(H, spec.bits)
        zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
        parts = {}
        if n := spec.n_outliers(H):
            channels = lambda: jnp.zeros((n_pages, K, page_size, n), jnp.uint8)  # noqa: E731  (one buffer each)
            parts = dict(k_out=zeros(n_pages, K, page_size, n), k_out_idx=channels())
            parts |= dict(v_out=zeros(n_pages, K, page_size, n), v_out_idx=channels())
        if spec.scheme.exact_sinks:
            parts |= dict(k_sink=zeros(batch, K, spec.sinks, H), v_sink=zeros(batch, K, spec.sinks, H))
        if r := spec.rank:
            parts |= dict(k_lr_q=zeros(n_pages, K, page_size, r), k_lr_p=zeros(n_pages, K, H, r))
            parts |= dict(v_lr_q=zeros(n_pages, K, page_size, r), v_lr_p=zeros(n_pages, K, H, r))
        return cls(
            k=jnp.zeros((n_pages, K, page_size, w), jnp.uint8),
            v=jnp.zeros((n_pages, K, page_size, w), jnp.uint8),
            pos=jnp.full((n_pages, 1, page_size), -1, jnp.int32),
            table=jnp.zeros((batch, max_pages), jnp.int32),
            length=jnp.zeros((batch,), jnp.int32),
            k_scale=zeros(n_pages, K, page_size // G, H),
            k_zero=zeros(n_pages, K, page_size // G, H),
            v_scale=zeros(n_pages, K, page_size, H // Gv),
            v_zero=zeros(n_pages, K, page_size, H // Gv),
            k_res=zeros(batch, K, R, H),
            v_res=zeros(batch, K, R, H),
            res_pos=jnp.full((batch, R), -1, jnp.int32),
            res_rows=jnp.zeros((batch,), jnp.int32),
            bits=spec.bits,
            spec=spec,
            **parts,
        )

    def _pools(self) -> dict[str, jax.Array]:
        """The page arrays `[P,...]` (a page's bytes; what a page copy moves): codes, scales, zero points
        and positions; the residuals are per sequence slot (`slot_nbytes`)."""
        names = ("k", "v", "pos", "k_scale", "k_zero", "v_scale", "v_zero", *_OUTLIERS.values(), *_LOW_RANK.values())
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _slotted(self) -> dict[str, jax.Array]:
        """The per-sequence-slot arrays `[S,...]`: the residual, and KVQuant's exact sinks."""
        names = ("k_res", "v_res", "res_pos", "k_sink", "v_sink")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _carried(self) -> dict[str, jax.Array]:
        return self._pools() | self._slotted()

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one sequence slot: its residual's K, V and positions (and KVQuant's exact sinks)."""
        return sum(x[0].nbytes for x in self._slotted().values())

    @property
    def _head_dim(self) -> int:
        return self.k_res.shape[-1]

    def _put_groups(self, first: jax.Array, k_scale: jax.Array, k_zero: jax.Array) -> PagedKiviCache:
        """Key scales and zero points `[N,K,H]` of the key groups whose first tokens sit at flat slots `[N]`."""
        page, row = first // self.page_size, first % self.page_size // self.spec.group
        put = lambda pool, x: pool.at[page, :, row].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
        return self.replace(k_scale=put(self.k_scale, k_scale), k_zero=put(self.k_zero, k_zero))

    def _store_block(self, start: jax.Array, ok: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array):
        """Quantize each row's block of `residual` tokens k, v `[B,K,R,H]` (positions `[B,R]`) as KIVI does
        and write it at the row's slots [start, start + R) where `ok` `[B]`."""
        spec, R = self.spec, self.spec.residual
        G, Gv = spec.group, spec.value_group(self._head_dim)
        exact_k, exact_v, out, per_slot = k, v, None, {}
        if self.k_out is not None:  # dense and sparse: each vector's outliers exact, out of the range
            k, v, out = Outliers.taken_from(k, v, self.k_out.shape[-1], spec.scheme.outliers == "extremes")
            per_slot = _named(out, _OUTLIERS)
        kc, ks, kz = quantize(k.swapaxes(2, 3), spec.bits, G, symmetric=False)  # [B,K,H,R], [B,K,H,R/G]
        vc, vs, vz = quantize(v, spec.bits, Gv, symmetric=False)  # [B,K,R,H], [B,K,R,H/Gv]
        index = start[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]
        flat = self._flat_slots(self._ringed(index), ok[:, None])  # [B,R]
        per_page = {}
        if self.k_lr_q is not None:  # GEAR: the block's error (exact - dequantized, outliers back) in rank r
            recon_k = dequantize(kc, ks, kz, spec.bits, G).swapaxes(2, 3)
            recon_v = dequantize(vc, vs, vz, spec.bits, Gv)
            if out is not None:
                recon_k, recon_v = out.apply(recon_k, recon_v)
            (k_q, k_p), (v_q, v_p) = (
                block_error_factors(x, recon, R, spec.rank) for x, recon in ((exact_k, recon_k), (exact_v, recon_v))
            )
            per_slot |= dict(k_lr_q=k_q, v_lr_q=v_q)
            per_page = dict(k_lr_p=k_p[:, :, 0], v_lr_p=v_p[:, :, 0])  # [B,K,H,r]: the block's page, its first slot's
        new = self._scatter(
            flat.reshape(-1),
            k=_slot_major(pack(kc.swapaxes(2, 3), spec.bits)),
            v=_slot_major(pack(vc, spec.bits)),
            v_scale=_slot_major(vs),
            v_zero=_slot_major(vz),
            pos=pos.reshape(-1, 1),
            **{name: _slot_major(x) for name, x in per_slot.items()},
        )
        new = new._put_pages(flat[:, 0] // self.page_size, per_page)
        groups = lambda x: x.transpose(0, 3, 1, 2).reshape(-1, *x.shape[1:3])  # noqa: E731  [B,K,H,R/G] -> [B*R/G,K,H]
        return new._put_groups(flat[:, ::G].reshape(-1), groups(ks), groups(kz))

    def _put_pages(self, pages: jax.Array, values: dict[str, jax.Array]) -> PagedKiviCache:
        """Per-page arrays (GEAR's P `[N,K,H,r]`) into pages `[N]` (past the pool: dropped)."""
        put = lambda name, x: getattr(self, name).at[pages].set(x.astype(getattr(self, name).dtype), mode="drop")  # noqa: E731
        return self.replace(**{name: put(name, x) for name, x in values.items()})

    def load_quant(self, row: int, dense: QuantKVCache) -> PagedKiviCache:
        """Sequence slot `row` (its table set) from row 0 of a Generator's KIVI cache: its codes into the
        pages, its residual into the row's residual slot."""
        n, nq, R, G = dense.length[0], dense.n_quant[0], self.spec.residual, self.spec.group
        S = dense.pos.shape[1]
        index = jnp.arange(S, dtype=jnp.int32)[None]
        flat = self.replace(table=self.table[row][None])._flat_slots(index, index < nq)[0]
        slot_major = lambda x: jnp.moveaxis(x[0], 1, 0)  # noqa: E731  [1,K,S,...] -> [S,K,...]
        per_slot = {} if dense.outliers is None else _named(dense.outliers, _OUTLIERS)
        per_page = {}
        if dense.low_rank is not None:  # GEAR: Q per slot, each block's P into the page that holds it
            factors = _named(dense.low_rank, _LOW_RANK)
            per_slot |= dict(k_lr_q=factors["k_lr_q"], v_lr_q=factors["v_lr_q"])
            per_page = dict(k_lr_p=slot_major(factors["k_lr_p"]), v_lr_p=slot_major(factors["v_lr_p"]))
        new = self._scatter(
            flat,
            k=slot_major(dense.k_codes),
            v=slot_major(dense.v_codes),
            v_scale=slot_major(dense.v_scale.swapaxes(2, 3)),
            v_zero=slot_major(dense.v_zero.swapaxes(2, 3)),
            pos=dense.pos[0][:, None],
            **{name: slot_major(x) for name, x in per_slot.items()},
        )
        new = new._put_pages(flat[::R] // self.page_size, per_page)
        new = new._put_groups(flat[::G], slot_major(dense.k_scale), slot_major(dense.k_zero))
        at = nq + jnp.arange(R, dtype=jnp.int32)
        res_pos = jnp.where(at < n, dense.pos[0][jnp.minimum(at, S - 1)], -1)
        slot = self.res_rows[row]
        rows = dict(k_res=dense.k_res[0], v_res=dense.v_res[0], res_pos=res_pos)
        if dense.sinks is not None:
            rows |= dict(k_sink=dense.sinks.k[0], v_sink=dense.sinks.v[0])
        put = lambda name, x: getattr(new, name).at[slot].set(x.astype(getattr(new, name).dtype), mode="drop")  # noqa: E731
        return new.replace(**{name: put(name, x) for name, x in rows.items()}, length=new.length.at[row].set(n))

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PagedKiviCache, KVView]:
        """A decode token per row (a mixed step without a prompt chunk: k, v `[1,B,K,H]`, pos `[1,B]`, -1
        where a row feeds none) into its residual, flushing each residual this fills into its pages; the
        view of every row's codes, dequantized, then its residual."""
        B = self.table.shape[0]
        if self.chunk_row is None or k.shape[:2] != (1, B) or pos.shape != (1, B):
            raise ValueError(
                f"KIVI pages take one decode token per row ({B} rows), not k {k.shape} at pos {pos.shape}: "
                "a prompt is loaded whole (load_quant) and generated tokens are re-fed a step at a time"
            )
        R, rows = self.spec.residual, self.res_rows
        k, v, pos = k[0][:, :, None], v[0][:, :, None], pos[0]  # [B,K,1,H], [B]
        if self.spec.scheme.pre_rope_keys:  # KVQuant: keys held before RoPE
            k = rotate_slots(k, -pos[:, None], self.spec.rope_theta)
        fed, held = pos >= 0, self.length % R  # a residual holds the tokens past the last full block
        at = (jnp.arange(R)[None, :] == held[:, None]) & fed[:, None]  # [B,R]
        read = lambda x: x.at[rows].get(mode="fill", fill_value=0)  # noqa: E731
        k_res = jnp.where(at[:, None, :, None], k.astype(self.k_res.dtype), read(self.k_res))
        v_res = jnp.where(at[:, None, :, None], v.astype(self.v_res.dtype), read(self.v_res))
        res_pos = jnp.where(at, pos[:, None], self.res_pos.at[rows].get(mode="fill", fill_value=-1))
        length = self.length + fed
        flush = fed & (held + 1 == R)
        new = self._store_block(length - R, flush, k_res, v_res, res_pos)
        res_pos = jnp.where(flush[:, None], -1, res_pos)
        new = new.replace(
            k_res=self.k_res.at[rows].set(k_res, mode="drop"),
            v_res=self.v_res.at[rows].set(v_res, mode="drop"),
            res_pos=self.res_pos.at[rows].set(res_pos, mode="drop"),
            length=length,
        )
        if self.k_sink is not None:  # the first tokens a row holds, also exact beside their codes
            index = jnp.where(fed, self.length, self.k_sink.shape[2])  # (past the sinks: dropped)
            sink = lambda buf, x: buf.at[rows, :, index].set(x[:, :, 0].astype(buf.dtype), mode="drop")  # noqa: E731
            new = new.replace(k_sink=sink(self.k_sink, k), v_sink=sink(self.v_sink, v))
        view = new._kivi_view(k_res, v_res, res_pos)
        return new, view._replace(reader=RowSplit(view, view, None))

    def _kivi_view(self, k_res: jax.Array, v_res: jax.Array, res_pos: jax.Array) -> KVView:
        """Every row's codes (the slots below its last full block) dequantized in table order, then its
        residual: k, v `[B,K,M*page_size+R,H]` (fp32), positions `[B,M*page_size+R]`."""
        spec, H = self.spec, self._head_dim
        B, M = self.table.shape
        gather = lambda pool: pool[self.table].swapaxes(1, 2).reshape(B, pool.shape[1], -1, *pool.shape[3:])  # noqa: E731
        kc, vc = unpack(gather(self.k), spec.bits), unpack(gather(self.v), spec.bits)  # [B,K,M*ps,H]
        k = dequantize(
            kc.swapaxes(2, 3),
            gather(self.k_scale).swapaxes(2, 3),
            gather(self.k_zero).swapaxes(2, 3),
            spec.bits,
            spec.group,
        ).swapaxes(2, 3)
        v = dequantize(vc, gather(self.v_scale), gather(self.v_zero), spec.bits, spec.value_group(H))
        if self.k_lr_q is not None:  # GEAR's error: each slot's Q times its page's (block's) P
            pages = lambda pool: pool[self.table].swapaxes(1, 2)  # noqa: E731  [P,K,H,r] -> [B,K,M,H,r]
            q = dict(k_q=gather(self.k_lr_q), v_q=gather(self.v_lr_q))
            k, v = LowRankError(**q, k_p=pages(self.k_lr_p), v_p=pages(self.v_lr_p), residual=spec.residual).apply(k, v)
        if self.k_out is not None:
            k, v = Outliers(**{field: gather(getattr(self, name)) for field, name in _OUTLIERS.items()}).apply(k, v)
        if self.k_sink is not None:  # a row's first slots hold its first tokens (no ring holds KVQuant's codes)
            n = min(self.k_sink.shape[2], k.shape[2])
            sinks = lambda x, buf: x.at[:, :, :n].set(buf.at[self.res_rows].get(mode="fill", fill_value=0)[:, :, :n])  # noqa: E731
            k, v = sinks(k, self.k_sink), sinks(v, self.v_sink)
        coded = self.length // spec.residual * spec.residual  # (a ring's slots past C: null pages, no position)
        slot = jnp.arange(M * self.page_size, dtype=jnp.int32)[None, :]
        pos = jnp.where(slot < coded[:, None], gather(self.pos)[:, 0], -1)
        join = lambda a, b: jnp.concatenate([a, b.astype(jnp.float32)], axis=2)  # noqa: E731
        k, v, pos = join(k, k_res), join(v, v_res), jnp.concatenate([pos, res_pos], axis=1)
        if spec.scheme.pre_rope_keys:  # RoPE at each slot's true position
            k = rotate_slots(k, pos, spec.rope_theta)
        return KVView(k, v, pos)


def _named(part, names: dict[str, str]) -> dict[str, jax.Array]:
    """A part's arrays (`Outliers`, `LowRankError`: a Generator cache's or a block's) under the names the
    pages keep them by (`_OUTLIERS`, `_LOW_RANK`)."""
    return {name: getattr(part, field) for field, name in names.items()}

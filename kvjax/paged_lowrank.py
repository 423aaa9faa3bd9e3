"""Palu's and LoRC's latents in pages (`kvjax.quant.lowrank`: Chang et al. 2024, sec. 3.2-3.4; Zhang et al.
2024): a page holds, for each of its `page_size` tokens and each group of KV heads, the rank-r latents of the
group's pre-RoPE key and of its value, as `LowRankKVCache` holds them per slot; the layer's bases ride along
as weights (not page bytes). A new token's key is rotated back at its position and projected, its value
projected, and only the latents are written; the view gathers a row's latents, maps them out with the bases
and rotates each key at its slot's position, so attention reads the K/V that `LowRankKVCache.reconstructed`
gives. A page is then 2 x groups x r values a token where the K/V pages hold 2 x heads x head_dim.

The decode queries read the gathered, rebuilt K/V (never the whole pool, `PagedKVCache.attend_pool`, nor the
paged kernel: both read the pages as K/V). Prompts are compressed whole by the Generator and loaded latent
for latent (`Engine._load_row`); a preempted request's generated tokens are re-fed as a chunk, which projects
them as decoding did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVView
from kvjax.paged import PagedKVCache, RowSplit
from kvjax.quant.lowrank import latents, rebuilt


@struct.dataclass
class PagedLowRankCache(PagedKVCache):
    """One layer's latent pages: k, v `[P,Kg,page_size,r]` (the key and value latents of each head group),
    positions `[P,1,page_size]`; the group bases k_basis, v_basis `[Kg,g*H,r]` of the layer (weights);
    `n_kv_heads` K = Kg x g, and the RoPE base the keys are rotated back and again at."""

    k_basis: jax.Array | None = None
    v_basis: jax.Array | None = None
    n_kv_heads: int = struct.field(pytree_node=False, default=1)
    rope_theta: float = struct.field(pytree_node=False, default=10_000.0)

    @classmethod
    def init_low_rank(
        cls, k_basis, v_basis, n_kv_heads: int, rope_theta: float, n_pages, page_size, batch, max_pages, dtype
    ) -> PagedLowRankCache:
        Kg, _, r = k_basis.shape
        pages = cls.init(n_pages, page_size, batch, max_pages, Kg, r, dtype)
        own = lambda basis: jnp.array(basis, copy=True)  # noqa: E731  (the engine's steps donate their caches)
        return pages.replace(k_basis=own(k_basis), v_basis=own(v_basis), n_kv_heads=n_kv_heads, rope_theta=rope_theta)

    def update(self, k: jax.Array, v: jax.Array, pos: jax.Array) -> tuple[PagedLowRankCache, KVView]:
        """Append k, v `[B,T,K,H]` (post-RoPE keys) at positions `[B,T]` as their latents `[B,T,Kg,r]`."""
        head_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  (and back: the same swap)
        zk, zv = latents(head_major(k), head_major(v), pos, self.k_basis, self.v_basis, self.rope_theta)
        return super().update(head_major(zk).astype(self.k.dtype), head_major(zv).astype(self.v.dtype), pos)

    def _gather(self) -> KVView:
        """The rows' latents gathered, rebuilt: K rotated at each slot's position, V `[B,K,M*page_size,H]`."""
        z = super()._gather()
        k, v = rebuilt(z.k, z.v, z.pos, self.k_basis, self.v_basis, self.n_kv_heads, self.rope_theta)
        return KVView(k.astype(self.k.dtype), v.astype(self.v.dtype), z.pos)

    @staticmethod
    def _split(rows: KVView, chunk: KVView, pool: PagedKVCache | None) -> KVView:
        return rows._replace(reader=RowSplit(rows, chunk))  # the rebuilt rows, never the pool of latents

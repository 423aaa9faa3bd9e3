"""D2O in the engine's pages (Wan et al. 2024, arXiv 2406.13035; `kvjax.compress.d2o` holds the method): its
layers keep the budgets the prefill's attention planned, each with a block table of its own
(`kvjax.layer_pages`, as PyramidKV's), and every decode step re-selects them by H2O's sums and merges what it
evicts (`kvjax.paged_eviction`, the Generator's own `compress_caches` on each row's dense view). The merge's
threshold tau is a moving average per sequence and layer: each layer keeps it per sequence slot beside its
pages, hands it to the dense view a step re-selects and takes the new one back for the rows it compacted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.compress.d2o import D2OKVCache
from kvjax.paged import PagedKVCache


@struct.dataclass
class PagedD2OCache(PagedKVCache):
    """One layer's D2O pages: a `PagedKVCache` with H2O's running sums, and its merge threshold `tau` `[S]`
    per sequence slot (NaN before the first merge) with `tau_rows` `[B]`, each table row's slot."""

    tau: jax.Array | None = None
    tau_rows: jax.Array | None = None

    @classmethod
    def init_d2o(cls, n_pages: int, page_size: int, batch: int, max_pages: int, K: int, H: int, dtype, per_head: bool):
        """`per_head`: positions per KV head (its heads keep different tokens)."""
        pages = PagedKVCache.init(
            n_pages, page_size, batch, max_pages, K, H, dtype, per_head_positions=per_head, stat=True
        )
        return cls(
            **{f.name: getattr(pages, f.name) for f in dataclasses.fields(pages)},
            tau=jnp.full((batch,), jnp.nan, jnp.float32),
            tau_rows=jnp.full((batch,), batch, jnp.int32),
        )

    def _carried(self) -> dict:
        return self._pools() | dict(tau=self.tau)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one sequence slot: its threshold."""
        return self.tau[0].nbytes

    def _row_tau(self) -> jax.Array:
        return self.tau.at[self.tau_rows].get(mode="fill", fill_value=jnp.nan)

    def dense(self, slots: int) -> D2OKVCache:
        view = super().dense(slots)
        return D2OKVCache(k=view.k, v=view.v, pos=view.pos, length=view.length, tau=self._row_tau())

    def compact(self, rows: jax.Array, dense) -> PagedD2OCache:
        """`PagedKVCache.compact`, and the rows' new thresholds where the re-selection merged (`D2OKVCache`)."""
        new = super().compact(rows, dense)
        if not isinstance(dense, D2OKVCache):
            return new
        tau = jnp.where(rows, dense.tau, self._row_tau())
        return new.replace(tau=self.tau.at[self.tau_rows].set(tau, mode="drop"))

    def load_tau(self, row: int, dense) -> PagedD2OCache:
        """Sequence slot `row`'s threshold from row 0 of a Generator's cache (NaN where it never merged)."""
        tau = dense.tau[0] if isinstance(dense, D2OKVCache) else jnp.float32(jnp.nan)
        return self.replace(tau=self.tau.at[self.tau_rows[row]].set(tau, mode="drop"))

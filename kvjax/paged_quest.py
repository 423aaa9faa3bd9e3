"""Quest in pages (Tang et al. 2024, arXiv 2406.10774, sec. 3): Quest's pages are the engine's. Nothing is
evicted; beside its K/V, positions and table, each page keeps the channel-wise min and max of its keys per KV
head (written with the keys, so a prefix-cache page carries them to every request that shares it), and a
decode row reads only its `read` pages whose bound on q.k is highest, the page of its newest token always
among them (`kvjax.cache.quest_bounds`), as `kvjax.cache.QuestKVCache.select` does over a dense cache. The
pages not read are masked, per KV head, out of the gathered rows (where the dense cache gathers the pages read:
the same keys); a prompt chunk reads every page, as the Generator's prefill does. Each row's `read` is its
request's budget at the prefill (every page for a request without Quest), pushed with the step's rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVView, quest_bounds
from kvjax.paged import PagedKVCache, RowSplit

READ_ALL = 2**30  # a row's `read` that reads every page (a request that Quest does not compress)


@struct.dataclass
class PagedQuestCache(PagedKVCache):
    """One layer's pages with Quest's key bounds: page_min, page_max `[P,K,H]` (a page's keys' channel-wise
    min and max per KV head, over the slots written since the page was begun: page arrays, so a page's bytes,
    copies and placement on a mesh count them) and, set by each step from `Rows.budgets`, the pages each row
    reads per decode step, read `[B]`."""

    page_min: jax.Array | None = None
    page_max: jax.Array | None = None
    read: jax.Array | None = None

    @classmethod
    def init_quest(cls, n_pages, page_size, batch, max_pages, n_kv_heads, head_dim, dtype) -> PagedQuestCache:
        pages = cls.init(n_pages, page_size, batch, max_pages, n_kv_heads, head_dim, dtype)
        bound = lambda fill: jnp.full((n_pages, n_kv_heads, head_dim), fill, dtype)  # noqa: E731
        return pages.replace(page_min=bound(jnp.inf), page_max=bound(-jnp.inf))

    def _pools(self) -> dict[str, jax.Array]:
        return super()._pools() | dict(page_min=self.page_min, page_max=self.page_max)

    def _write(self, flat: jax.Array, **values: jax.Array) -> PagedQuestCache:
        """`PagedKVCache._write`, each written key also into its page's bounds; a write at a page's first slot
        begins the page (a page from the free list forgets its old tokens' bounds)."""
        new = super()._write(flat, **values)
        if "k" not in values:
            return new
        P, ps = self.k.shape[0], self.page_size
        page = flat // ps  # dropped slots: page P, out of range
        begun = jnp.where(flat % ps == 0, page, P)
        k = values["k"].astype(self.page_min.dtype)  # [N,K,H]
        page_min = new.page_min.at[begun].set(jnp.inf, mode="drop").at[page].min(k, mode="drop")
        page_max = new.page_max.at[begun].set(-jnp.inf, mode="drop").at[page].max(k, mode="drop")
        return new.replace(page_min=page_min, page_max=page_max)

    def _split(self, rows: KVView, chunk: KVView, pool) -> KVView:
        """A mixed step's reader: the decode rows over the pages each reads (`selected`), the chunk over all of
        its row's pages; never the whole pool, which every row would read whole."""
        return rows._replace(reader=RowSplit(rows, chunk, select=self.selected))

    def selected(self, q: jax.Array, view: KVView, q_pos: jax.Array) -> KVView:
        """The rows' gathered view `view` (k, v `[R,K,S,H]`, pos `[R,S]`) as decode queries q `[R,1,N,H]`
        read it: per KV head, a slot whose page is not among the row's `read` best reads position -1, so
        attention skips it (ties go to the earlier page, as `jax.lax.top_k`'s do in the dense cache)."""
        R, K, S = view.k.shape[:3]
        ps = self.page_size
        M = S // ps
        filled = jnp.arange(M)[None, :] * ps < self.length[:, None]  # [R,M]
        newest = jnp.argmax(view.pos, axis=1) // ps
        bounds = [x[self.table].transpose(0, 2, 1, 3) for x in (self.page_min, self.page_max)]  # [R,K,M,H]
        bound = quest_bounds(q, *bounds, filled, newest)  # [R,K,M]
        order = jnp.argsort(-bound, axis=-1, stable=True)  # best first, ties to the earlier page (as top_k's)
        chosen = jnp.argsort(order, axis=-1) < self.read[:, None, None]  # [R,K,M]: a page's rank within its budget
        pos = jnp.where(jnp.repeat(chosen, ps, axis=2), view.pos[:, None], -1)
        return KVView(view.k, view.v, pos)

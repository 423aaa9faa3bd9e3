"""SnapKV (Li et al. 2024, arXiv 2404.14469, eqs. in sec. 4.2): the attention of the last `obs_window`
prompt queries, summed, averaged over the query heads of each KV head, then pooled over neighbouring
slots with a 1-D kernel (average, kernel 5, zero padded as F.avg_pool1d). As in the reference code,
only the keys before the window are pooled (the window's own slots count as the zero padding), so
attention paid to window keys never leaks into the slots next to them. An AdaKV pool scores entries
`[B,1,P]`: each is pooled with its own head's entries in position order (`pool_by_head`), which at
prefill is the per-head pooling of the dense layout (what AdaKV's and kvpress's code pool before
flattening the heads)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.cache import PooledKVCache
from kvjax.compress.methods.base import Method, Observed, attention_received, register, slot_positions, voters
from kvjax.config import ConfigError

POOLINGS = ("avg", "max")


@register
class SnapKV(Method):
    name = "snapkv"
    pageable = True
    per_head = True

    @dataclasses.dataclass(frozen=True)
    class Options(Observed):
        kernel: int = 5  # the 1-D pooling kernel over neighbouring slots (odd: centred)
        pooling: str = "avg"

        def check(self, where):
            super().check(where)
            self.at_least_one(where, "kernel")
            if self.kernel % 2 == 0:
                raise ConfigError(f"{where}: kernel={self.kernel} must be odd (centred pooling)")
            if self.pooling not in POOLINGS:
                raise ConfigError(f"{where}: pooling={self.pooling!r} must be one of {POOLINGS}")

    def window(self, stage, keep):
        return stage.options.obs_window  # the voting window is kept

    def fixed_window(self, stage):
        return stage.options.obs_window

    def observed_queries(self, stage, length):
        return min(stage.options.obs_window, length)

    def observe(self, stage, probs, obs_pos, pooled, visible=None, queries=None):
        per_query = attention_received(probs, voters(obs_pos, stage.options.obs_window))
        return per_query.sum(axis=1, keepdims=True) if pooled else per_query

    def score(self, stage, cache, stat, last_pos):
        pos = slot_positions(cache)
        in_window = pos > (last_pos[:, None, None] - stage.options.obs_window)  # kept anyway; pooled as padding
        stat = jnp.where(in_window, 0.0, stat)
        if isinstance(cache, PooledKVCache):
            return pool_by_head(stat, cache.head[:, None], pos, stage.options.kernel, stage.options.pooling)
        return pool(stat, stage.options.kernel, stage.options.pooling)


def pool(x: jax.Array, kernel: int, how: str) -> jax.Array:
    """Centred 1-D pooling over the last axis with zero padding (avg counts the padding, as torch's
    avg_pool1d with count_include_pad)."""
    pad = kernel // 2
    init, op = (0.0, jax.lax.add) if how == "avg" else (-jnp.inf, jax.lax.max)
    dims = (1,) * (x.ndim - 1) + (kernel,)
    padding = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    out = jax.lax.reduce_window(x, init, op, dims, (1,) * x.ndim, padding)
    return out / kernel if how == "avg" else out


def pool_by_head(x: jax.Array, head: jax.Array, pos: jax.Array, kernel: int, how: str) -> jax.Array:
    """`pool` over the entries of a pool `[B,1,P]`: each entry with the entries of its own head that
    neighbour it in position order; other heads' entries and empty ones count as the zero padding."""
    order = jnp.lexsort((pos, head), axis=-1)  # by head, then position
    xs, hs, ps = (jnp.take_along_axis(a, order, axis=-1) for a in (x, head, pos))
    half = kernel // 2
    fill = 0.0 if how == "avg" else -jnp.inf
    widths = ((0, 0),) * (x.ndim - 1) + ((half, half),)
    xp = jnp.pad(xs, widths, constant_values=fill)
    hp, pp = jnp.pad(hs, widths, constant_values=-1), jnp.pad(ps, widths, constant_values=-1)
    P = x.shape[-1]
    parts = [
        jnp.where((hp[..., o : o + P] == hs) & (pp[..., o : o + P] >= 0), xp[..., o : o + P], fill)
        for o in range(kernel)
    ]
    out = sum(parts) / kernel if how == "avg" else functools.reduce(jnp.maximum, parts)
    return jnp.take_along_axis(out, jnp.argsort(order, axis=-1), axis=-1)  # back to the pool's order

"""Scissorhands (Liu et al. 2023, arXiv 2305.17118, alg. 1-2, "persistence of importance"): over a
history window of the last `obs_window` queries, count how often each token's attention was below the
average 1/n (n the tokens that query could see), summed over the head's query group; the tokens with
the most such counts go first (score = -count; ties keep the newer token). During decoding (`every=`)
the counts keep accumulating over every decode query (the paper slides the window)."""

import jax.numpy as jnp

from kvjax.compress.methods.base import Method, Observed, register, slot_positions, voters


@register
class Scissorhands(Method):
    name = "scissorhands"
    pageable = True  # its counts sum over the steps in the pages, as H2O's attention does
    per_head = True
    accumulates = True
    counts_visible = True  # each query's average 1/n is over the keys it could see
    Options = Observed  # obs_window: the history window

    def window(self, stage, keep):
        return stage.options.obs_window  # the history window

    def fixed_window(self, stage):
        return stage.options.obs_window

    def observed_queries(self, stage, length):
        return min(stage.options.obs_window, length)

    def observe(self, stage, probs, obs_pos, pooled, visible=None, queries=None):
        n = jnp.maximum(jnp.sum(visible, axis=-1, keepdims=True), 1)
        below = (visible & (probs < 1.0 / n)).astype(jnp.float32)  # below this query's average
        voter = voters(obs_pos, stage.options.obs_window)
        per_query = jnp.where(voter[:, None, :, None, None], below, 0.0).sum(axis=(2, 3))
        return per_query.sum(axis=1, keepdims=True) if pooled else per_query

    def score(self, stage, cache, stat, last_pos):
        pos = slot_positions(cache)
        return -stat + 0.5 * pos / (jnp.max(pos) + 1.0)  # fewest below-average counts first; ties keep the newer

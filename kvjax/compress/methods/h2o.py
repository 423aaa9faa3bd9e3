"""H2O (Zhang et al. 2023, arXiv 2306.14048, sec. 3.2): heavy hitters, the keys that received the most
attention summed over every query so far (prefill and decode), with recent tokens in equal part (half
the budget each). `normalize` divides by the number of queries that could see each key, as kvpress's
observed-attention press does."""

import dataclasses

import jax.numpy as jnp

from kvjax.compress.methods.base import Method, Options, attention_received, register, slot_positions, voters


@register
class H2O(Method):
    name = "h2o"
    pageable = True
    per_head = True
    accumulates = True
    additive = True  # attention received, summed over every prompt query: observed a block at a time

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        normalize: bool = False  # divide by the number of queries that saw each key (kvpress)

    def window(self, stage, keep):
        return keep // 2

    def observed_queries(self, stage, length):
        return length

    def observe(self, stage, probs, obs_pos, pooled, visible=None, queries=None):
        per_query = attention_received(probs, voters(obs_pos, None))
        return per_query.sum(axis=1, keepdims=True) if pooled else per_query  # a pool: only own head's are non-zero

    def score(self, stage, cache, stat, last_pos):
        if not stage.options.normalize:
            return stat
        seen = jnp.maximum(last_pos[:, None, None] - slot_positions(cache) + 1, 1)
        return stat / seen

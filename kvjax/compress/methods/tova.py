"""TOVA (Oren et al. 2024, arXiv 2401.06104): the last query's attention, averaged over all heads."""

from kvjax.compress.methods.base import Method, attention_received, register, voters


@register
class TOVA(Method):
    name = "tova"
    pageable = True

    def observed_queries(self, stage, length):
        return 1

    def observe(self, stage, probs, obs_pos, pooled, visible=None, queries=None):
        per_query = attention_received(probs, voters(obs_pos, 1))
        return (per_query.sum if pooled else per_query.mean)(axis=1, keepdims=True)

    def score(self, stage, cache, stat, last_pos):
        return stat

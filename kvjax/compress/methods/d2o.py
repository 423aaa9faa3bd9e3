"""D2O's scoring (Wan et al. 2024): H2O's accumulated attention with the first 4 positions kept, as its
reference code does; its layer budgets come from each layer's attention density at the prefill (sec.
3.1), and what it evicts is merged (`kvjax.compress.d2o` holds both)."""

from kvjax.compress import d2o
from kvjax.compress.methods.base import register
from kvjax.compress.methods.h2o import H2O


@register
class D2O(H2O):
    name = "d2o"
    pageable = False  # it evicts and merges at every decode step
    sinks = 4
    budgets_at_prefill = True
    extra_bytes_per_sequence = 4  # the merge threshold's moving average, fp32

    def layer_density(self, stat, pos):
        return d2o.layer_sigma(stat, pos)

    def layer_budgets(self, stage, density, lengths, never):
        return d2o.layer_counts(density, lengths, 1 - stage.ratio, never=never)

    def merge(self, stage, cache, idx, valid, stat):
        return d2o.merge(cache, idx, valid, stage.ema)

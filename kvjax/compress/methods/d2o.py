"""D2O's scoring (Wan et al. 2024): H2O's accumulated attention with the first 4 positions kept, as its
reference code does; its layer budgets come from each layer's attention density at the prefill (sec.
3.1), and what it evicts is merged (`kvjax.compress.d2o` holds both)."""

import dataclasses

from kvjax.compress import d2o
from kvjax.compress.methods.base import Options, register
from kvjax.compress.methods.h2o import H2O
from kvjax.config import ConfigError


@register
class D2O(H2O):
    name = "d2o"
    pageable = True  # its layers' own pages, re-selected and merged at every step (`kvjax.paged_d2o`)
    head_keys = True  # its merge compares each KV head's keys (MLA's latent has none)
    sinks = 4
    budgets_at_prefill = True
    extra_bytes_per_sequence = 4  # the merge threshold's moving average, fp32
    alone = "its layer budgets come from the whole prompt's attention"
    rings = "its layer budgets share one budget between layers by their attention over the whole prompt"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        ema: float = 0.5  # weight of the old merge threshold in its moving average

        def check(self, where):
            if not 0 <= self.ema <= 1:
                raise ConfigError(f"{where}: ema={self.ema} must be in [0, 1]")

    def validate(self, stage, where):
        if stage.allocator != "uniform" or stage.reducer != "select":
            raise ConfigError(
                f"{where}: D2O brings its own layer budgets and merge; allocator= and reducer= do not apply"
            )
        if stage.ratio is None:
            raise ConfigError(f"{where}: give the fraction of tokens removed on average, a ratio in [0, 1)")
        if not stage.every:  # D2O evicts (and merges) at every decode step
            object.__setattr__(stage, "every", 1)

    def score(self, stage, cache, stat, last_pos):
        return stat  # the accumulated attention itself (H2O's `normalize` is not among its options)

    def layer_density(self, stat, pos):
        return d2o.layer_sigma(stat, pos)

    def layer_budgets(self, stage, density, lengths, never):
        return d2o.layer_counts(density, lengths, 1 - stage.ratio, never=never)

    def merge(self, stage, cache, idx, valid, stat, target):
        return d2o.merge(cache, idx, valid, stage.options.ema, target.evicts)

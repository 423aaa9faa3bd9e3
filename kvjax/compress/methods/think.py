"""ThinK's observation (Xu et al. 2024): it scores key channels by the last `obs_window` prompt queries
(`kvjax.compress.think` prunes them); registered so that the prefill observes those queries."""

from kvjax.compress import think
from kvjax.compress.methods.base import Method, Observed, register
from kvjax.config import ConfigError


@register
class ThinK(Method):
    name = "think"
    head_keys = True
    poolable = False
    kind = "channels"
    recent = 32  # the reference's unpruned recent prompt tokens
    Options = Observed  # obs_window: the last prompt queries that score the channels

    def validate(self, stage, where):
        if stage.ratio is None:
            raise ConfigError(f"{where}: give the fraction of key channels removed, a ratio in [0, 1)")

    def observed_queries(self, stage, length):
        return min(stage.options.obs_window, length)

    def observe(self, stage, probs, obs_pos, pooled, visible=None, queries=None):
        return think.observe(stage, queries, obs_pos)

    def encode(self, stage, cache, stat, target):
        compact = cache.resized(target.keep_cap)  # the kept slots only; decoded tokens go to the tail
        ring = target.window is not None
        return think.ThinKCache.from_cache(compact, stat, stage.ratio, stage.recent, self.tail(target), ring)

    def tail(self, target) -> int:
        """Slots for the decoded tokens: the headroom; a ring's at most its window (a `WindowKVCache` tail)."""
        headroom = target.capacity - target.keep_cap
        return headroom if target.window is None else target.capped(headroom, target.window)

    def cache_bytes(self, stage, target, mem, K, item, positions, source):
        H = mem.kv_bytes_per_slot // (2 * K * item)
        return think.think_bytes(target.keep_cap, self.tail(target), K, H, stage.ratio, stage.recent, item, positions)

"""DuoAttention (Xiao et al. 2024): a fraction of the KV heads, chosen by learned gates, become streaming
heads that keep only attention sinks and a recent window; the rest keep every token (`kvjax.duo`).
The deployment defaults of the reference evaluation scripts: 64 sinks, a recent window of 256."""

import dataclasses

from kvjax.compress.methods.base import Method, Options, register
from kvjax.config import ConfigError
from kvjax.duo import DuoKVCache, duo_heads
from kvjax.kinds import INT32


@register
class Duo(Method):
    name = "duo"
    head_keys = True
    kind = "head_level"
    pageable = True  # its retrieval heads in the engine's pages, its streaming heads per sequence (`kvjax.paged_duo`)
    sinks = 64
    prepares = ("streaming",)
    recent = 256
    alone = "it sets what each KV head stores from the whole prompt"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        pattern: str = ""  # the learned gates (a JSON file); "": the model's own (see kvjax.duo)

        def check(self, where):
            if any(c in self.pattern for c in ":,+"):
                raise ConfigError(f"{where}: pattern={self.pattern!r} may not contain ':', ',' or '+'")

    def validate(self, stage, where):
        if stage.ratio is None:
            raise ConfigError(f"{where}: give the fraction of KV heads that stream, a ratio in [0, 1)")
        if stage.recent < 1:
            raise ConfigError(f"{where}: window={stage.window} (recent tokens) must be >= 1")

    def check(self, stage, cfg):
        duo_heads(stage, cfg)  # the pattern exists and has a gate for every KV head of the model

    def prepare(self, stage, model, caches, calibration=None, shapes_only=False):
        return {"streaming": duo_heads(stage, model.config)}

    def encode(self, stage, cache, stat, target):
        ring = target.window is not None  # a ring's retrieval heads keep it (its memory stays capped)
        kept = self._kept(target, cache.capacity)
        return DuoKVCache.from_cache(cache, target.streaming, stage.n_sinks, stage.recent, kept, ring)

    def cache_bytes(self, stage, target, mem, K, item, positions, source):
        # retrieval heads keep every slot; streaming heads their sinks and a recent ring
        streaming, head_bytes = len(target.streaming), mem.kv_bytes_per_slot // K
        kept = self._kept(target, source)
        parts = [(kept, K - streaming), (stage.n_sinks, streaming), (stage.recent, streaming)]
        return sum(n * (heads * head_bytes + INT32) + INT32 for n, heads in parts if heads and n)

    @staticmethod
    def _kept(target, source: int) -> int:
        """Slots of the retrieval heads: every token to come for a growing cache; a ring's own slots
        (`source`: its window, or the capacity when that is smaller) with local=true."""
        return target.capacity if target.window is None else source

"""MiniCache (Liu et al. 2024, arXiv 2405.14366, sec. 4): the top `ratio` of the compressible layers
merged in pairs, one SLERP direction per token and head and each layer's own magnitude
(`kvjax.compress.minicache` holds the merge and its choices)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.compress import minicache
from kvjax.compress.methods.base import Method, Options, register
from kvjax.config import ConfigError
from kvjax.memory import layer_memory
from kvjax.plan import compressible, kv_heads


@register
class MiniCache(Method):
    name = "minicache"
    kind = "layer_level"
    head_keys = True
    alone = "it merges pairs of layers"
    rings = "it merges pairs of neighbouring compressible caches, and a ring holds another span of tokens"

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        t: float = 0.6  # SLERP interpolation between the lower (0) and upper (1) layer (eq. 3)
        retain: float = 0.05  # fraction of tokens per head whose originals are kept unmerged

        def check(self, where):
            if not 0 <= self.t <= 1 or not 0 <= self.retain <= 1:
                raise ConfigError(f"{where}: t={self.t} and retain={self.retain} must be in [0, 1]")

    def validate(self, stage, where):
        if stage.ratio is None:
            raise ConfigError(f"{where}: give the fraction of layers merged, a ratio in [0, 1)")

    def check(self, stage, cfg):
        if len({kv_heads(cfg, s) for s in compressible(cfg)}) > 1:
            raise ConfigError(
                f"policy stage 'minicache': MiniCache merges layers of one K/V shape; {cfg.name!r} mixes KV head counts"
            )

    def merge_layers(self, stage, caches, slots, keep_caps, capacities):
        opts = stage.options
        return minicache.merge_caches(caches, slots, stage.ratio, keep_caps, capacities, opts.t, opts.retain)

    def layers_bytes(self, stage, cfg, keep_caps, capacities):
        slots, item, out = compressible(cfg), jnp.dtype(cfg.dtype).itemsize, {}
        for a, b in minicache.merged_pairs(len(slots), stage.ratio):
            K = kv_heads(cfg, slots[a])
            H = layer_memory(cfg)[slots[a]].kv_bytes_per_slot // (2 * K * item)
            tail = capacities[a] - keep_caps[a]
            out[slots[a]], out[slots[b]] = minicache.merged_bytes(keep_caps[a], tail, K, H, item, stage.options.retain)
        return out

"""The layer plan: per layer, its mixer kind and which layer's K/V it attends to.

`kv_source[i] == i` means layer i computes and caches its own K/V (a producer); `kv_source[i] == j < i`
means it reads producer j's cache and stores nothing. The model, the caches and memory accounting all
read the same plan, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import MIXER_KINDS, ConfigError, ModelConfig, check_kv_source

SHARABLE_KINDS = ("attention", "swa")  # mixers with a K/V cache another layer can attend to
KV_KINDS = (*SHARABLE_KINDS, "mla")  # mixers that cache K/V (or an MLA latent) per token


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    mixers: tuple[str, ...]
    kv_source: tuple[int, ...]

    def __post_init__(self):
        if len(self.mixers) != len(self.kv_source):
            raise ConfigError(f"layer plan: {len(self.mixers)} mixers but {len(self.kv_source)} kv_source entries")
        for i, kind in enumerate(self.mixers):
            if kind not in MIXER_KINDS:
                raise ConfigError(f"layer plan: mixers[{i}]={kind!r} must be one of {MIXER_KINDS}")
        check_kv_source(self.kv_source, "layer plan: kv_source")
        for i, src in enumerate(self.kv_source):
            if src != i and not {self.mixers[i], self.mixers[src]} <= set(SHARABLE_KINDS):
                raise ConfigError(
                    f"layer plan: layer {i} ({self.mixers[i]}) reads layer {src} ({self.mixers[src]}); only "
                    f"{SHARABLE_KINDS} layers share K/V"
                )

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> LayerPlan:
        return cls(mixers=cfg.mixers, kv_source=cfg.kv_source)

    @property
    def n_layers(self) -> int:
        return len(self.mixers)

    @property
    def producers(self) -> tuple[int, ...]:
        """Layers that own a cache, in order; the model's cache tuple has one entry per producer."""
        return tuple(i for i, src in enumerate(self.kv_source) if src == i)

    def cache_index(self, layer: int) -> int:
        """Position in the cache tuple of the cache that `layer` reads."""
        return self.producers.index(self.kv_source[layer])


def compressible(cfg: ModelConfig) -> tuple[int, ...]:
    """Cache indices (positions in the model's cache tuple) of the caches a policy compresses."""
    plan = LayerPlan.from_config(cfg)
    out = []
    for slot, layer in enumerate(plan.producers):
        kind = plan.mixers[layer]
        if kind == "mla" or (kind in ("attention", "swa") and cfg.attention_for(kind).window is None):
            out.append(slot)
    return tuple(out)


def kv_heads(cfg: ModelConfig, slot: int) -> int:
    """KV heads of compressible cache `slot` (1 for an MLA latent, which serves every head)."""
    plan = LayerPlan.from_config(cfg)
    kind = plan.mixers[plan.producers[slot]]
    return 1 if kind == "mla" else cfg.attention_for(kind).n_kv_heads

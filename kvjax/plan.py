"""The layer plan: per layer, its mixer kind and which layer's K/V it attends to.

`kv_source[i] == i` means layer i computes and caches its own K/V (a producer); `kv_source[i] == j < i`
means it reads producer j's cache and stores nothing. The model, the caches and memory accounting all
read the same plan, and each layer's kind (`kvjax.kinds`) says what its cache is, so they cannot drift
apart.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import ConfigError, ModelConfig, check_kv_source
from kvjax.kinds import KINDS


def sharable_kinds() -> tuple[str, ...]:
    """Layer kinds whose K/V cache another layer may attend to."""
    return tuple(name for name, kind in KINDS.items() if kind.shares_kv)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    mixers: tuple[str, ...]
    kv_source: tuple[int, ...]

    def __post_init__(self):
        if len(self.mixers) != len(self.kv_source):
            raise ConfigError(f"layer plan: {len(self.mixers)} mixers but {len(self.kv_source)} kv_source entries")
        for i, kind in enumerate(self.mixers):
            if kind not in KINDS:
                raise ConfigError(f"layer plan: mixers[{i}]={kind!r} must be one of {tuple(KINDS)}")
        check_kv_source(self.kv_source, "layer plan: kv_source")
        for i, src in enumerate(self.kv_source):
            if src != i and not {self.mixers[i], self.mixers[src]} <= set(sharable_kinds()):
                raise ConfigError(
                    f"layer plan: layer {i} ({self.mixers[i]}) reads layer {src} ({self.mixers[src]}); only "
                    f"{sharable_kinds()} layers share K/V"
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


def compressible(cfg: ModelConfig, local: bool = False) -> tuple[int, ...]:
    """Cache indices (positions in the model's cache tuple) of the caches a policy compresses: those that
    grow with the sequence, and with `local` (a policy's `local=true`) the sliding-window rings too."""
    plan = LayerPlan.from_config(cfg)
    kinds = [KINDS[plan.mixers[layer]] for layer in plan.producers]
    return tuple(slot for slot, k in enumerate(kinds) if k.compressible(cfg) or (local and k.window(cfg) is not None))


def ring_window(cfg: ModelConfig, slot: int) -> int | None:
    """The sliding window of cache `slot` when it is a ring, else None."""
    plan = LayerPlan.from_config(cfg)
    return KINDS[plan.mixers[plan.producers[slot]]].window(cfg)


def rope_base(cfg: ModelConfig, slot: int) -> float:
    """The RoPE base of cache `slot`'s keys (Gemma's local layers have their own, `model.local`)."""
    plan = LayerPlan.from_config(cfg)
    return cfg.attention_for(plan.mixers[plan.producers[slot]]).rope_theta


def kv_heads(cfg: ModelConfig, slot: int) -> int:
    """KV heads of compressible cache `slot` (1 for an MLA latent, which serves every head)."""
    plan = LayerPlan.from_config(cfg)
    return KINDS[plan.mixers[plan.producers[slot]]].kv_heads(cfg)


def init_caches(cfg: ModelConfig, batch: int, capacity: int, *, fresh: bool = False) -> tuple:
    """Empty caches for every producer layer of the model's plan, in plan order (each its kind's cache).
    `fresh`: marked known empty (see `kvjax.cache._SlotCache.fresh`), for a prefill that writes its
    chunk in one update."""
    if batch <= 0 or capacity <= 0:
        raise ValueError(f"batch={batch} and capacity={capacity} must be > 0")
    plan = LayerPlan.from_config(cfg)
    return tuple(KINDS[plan.mixers[i]].init_cache(cfg, batch, capacity, fresh) for i in plan.producers)

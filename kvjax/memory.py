"""Analytic cache memory of a model config, computed from the layer plan (never from a live cache).

Only producer layers of the plan cache anything: with CLA / MLKV sharing, per-token K/V bytes are
2 x producers x n_kv_heads x head_dim x dtype bytes. An MLA layer caches its latent and shared RoPE key,
(kv_lora_rank + qk_rope_head_dim) x dtype bytes per token (DeepSeek-V2, sec. 2.1.2).

Tests assert that these numbers equal `cache.nbytes()` of real caches byte for byte.
Per producer layer and cached token: K and V (`2 * n_kv_heads * head_dim * dtype bytes`, the figure
papers report) plus the slot's int32 position. Per layer and sequence: the int32 length counter.
A sliding-window layer holds at most `window` tokens.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.cache import layer_slots
from kvjax.config import KVSharingConfig, ModelConfig
from kvjax.plan import LayerPlan

_INT32 = 4


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """Bytes one producer layer's cache takes for one sequence."""

    kv_bytes_per_slot: int  # K and V payload
    meta_bytes_per_slot: int  # the slot's position
    bytes_per_sequence: int  # fixed bookkeeping (the length counter)
    max_slots: int | None  # the sliding window, or None when the cache grows without bound

    def bytes(self, tokens: int) -> int:
        slots = layer_slots(self.max_slots, tokens)
        return slots * (self.kv_bytes_per_slot + self.meta_bytes_per_slot) + self.bytes_per_sequence


def layer_memory(cfg: ModelConfig) -> tuple[LayerMemory, ...]:
    """One entry per producer layer of the model's plan."""
    att, mla, item = cfg.attention, cfg.mla, jnp.dtype(cfg.dtype).itemsize
    per_kind = {
        "attention": LayerMemory(2 * att.n_kv_heads * att.head_dim * item, _INT32, _INT32, att.window),
        "mla": LayerMemory((mla.kv_lora_rank + mla.qk_rope_head_dim) * item, _INT32, _INT32, None),
    }
    plan = LayerPlan.from_config(cfg)
    return tuple(per_kind[plan.mixers[i]] for i in plan.producers)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """K/V payload bytes one token adds across all layers (no window cap, no metadata)."""
    return sum(m.kv_bytes_per_slot for m in layer_memory(cfg))


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Everything one cached token costs across all layers: K/V payload plus position metadata."""
    return sum(m.kv_bytes_per_slot + m.meta_bytes_per_slot for m in layer_memory(cfg))


def cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1) -> int:
    """Exact bytes of `init_caches(cfg, batch, capacity=tokens)`: every array of every layer's cache."""
    return batch * sum(m.bytes(tokens) for m in layer_memory(cfg))


def mha_reference(cfg: ModelConfig) -> ModelConfig:
    """The same shape with full multi-head attention: attention layers only, one K/V head per query head
    in every layer, no window, no cross-layer sharing."""
    att = dataclasses.replace(cfg.attention, n_kv_heads=cfg.attention.n_heads, window=None)
    return dataclasses.replace(
        cfg, name=f"{cfg.name}-mha", attention=att, kv_sharing=KVSharingConfig(), layer_pattern=("attention",)
    )

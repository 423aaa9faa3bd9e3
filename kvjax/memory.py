"""Analytic cache memory of a model config, computed from the layer plan (never from a live cache).

Tests assert that these numbers equal `nbytes()` of real caches byte for byte. Only producer layers of
the plan hold anything (CLA / MLKV consumers and YOCO's cross layers read another layer's cache). Two
figures describe a model:
- bytes per token of the caches that grow without bound: per attention producer K and V,
  `2 * n_kv_heads * head_dim * dtype bytes` (the figure papers report), plus an int32 position per slot;
  per MLA layer the latent and RoPE key(s), `(kv_lora_rank + rope_heads * qk_rope_head_dim) * dtype bytes`
  (DeepSeek-V2, sec. 2.1.2), plus the position;
- fixed bytes per sequence: sliding-window rings at their full `window` slots, recurrent states (gated
  retention: an fp32 `n_heads x head_dim x head_dim` S; Mamba: `d_conv - 1` conv inputs of the inner
  width plus an fp32 `inner x d_state` h; RWKV-7: two token-shift inputs plus an fp32
  `d_model / head_size` x head_size^2 S), and every cache's int32 length counter.
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
    mla, item = cfg.mla, jnp.dtype(cfg.dtype).itemsize

    def memory(kind: str) -> LayerMemory:
        if kind == "mla":
            return LayerMemory((mla.kv_lora_rank + mla.rope_heads * mla.qk_rope_head_dim) * item, _INT32, _INT32, None)
        if kind in ("gret", "retnet"):  # fp32 state S [N, H, Hv], nothing per token
            att = cfg.attention
            value_dim = att.head_dim * (cfg.retnet.value_factor if kind == "retnet" else 1)
            return LayerMemory(0, 0, att.n_heads * att.head_dim * value_dim * 4, 0)
        if kind == "rwkv":  # two token-shift inputs [D] in the model dtype + fp32 S [N, H, H]
            return LayerMemory(0, 0, 2 * cfg.d_model * item + cfg.d_model * cfg.rwkv.head_size * 4, 0)
        if kind == "mamba":  # conv buffer [d_conv - 1, E] in the model dtype + fp32 h [E, N]
            m, inner = cfg.mamba, cfg.mamba.expand * cfg.d_model
            return LayerMemory(0, 0, (m.d_conv - 1) * inner * item + inner * m.d_state * 4, 0)
        att = cfg.attention_for(kind)
        return LayerMemory(2 * att.n_kv_heads * att.head_dim * item, _INT32, _INT32, att.window)

    plan = LayerPlan.from_config(cfg)
    return tuple(memory(plan.mixers[i]) for i in plan.producers)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """K/V (or latent) payload one token adds to the caches that grow without bound (no metadata)."""
    return sum(m.kv_bytes_per_slot for m in layer_memory(cfg) if m.max_slots is None)


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Everything one token adds to the growing caches: payload plus position metadata."""
    return sum(m.kv_bytes_per_slot + m.meta_bytes_per_slot for m in layer_memory(cfg) if m.max_slots is None)


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Bytes per sequence that do not grow with it: full sliding-window rings, recurrent states, counters."""
    return sum(
        m.bytes_per_sequence + (m.max_slots or 0) * (m.kv_bytes_per_slot + m.meta_bytes_per_slot)
        for m in layer_memory(cfg)
    )


def cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1) -> int:
    """Exact bytes of `init_caches(cfg, batch, capacity=tokens)`: every array of every layer's cache."""
    return batch * sum(m.bytes(tokens) for m in layer_memory(cfg))


def mha_reference(cfg: ModelConfig) -> ModelConfig:
    """The same shape with full multi-head attention: attention layers only, one K/V head per query head
    in every layer, no window, no cross-layer sharing, no YOCO."""
    att = dataclasses.replace(cfg.attention, n_kv_heads=cfg.attention.n_heads, window=None)
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}-mha",
        attention=att,
        kv_sharing=KVSharingConfig(),
        layer_pattern=("attention",),
        yoco=None,
    )

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

from kvjax.config import KVSharingConfig, ModelConfig
from kvjax.kinds import KINDS, LayerMemory
from kvjax.plan import LayerPlan


def layer_memory(cfg: ModelConfig) -> tuple[LayerMemory, ...]:
    """One entry per producer layer of the model's plan: its kind's memory formula (`kvjax.kinds`)."""
    plan = LayerPlan.from_config(cfg)
    return tuple(KINDS[plan.mixers[i]].memory(cfg) for i in plan.producers)


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
    in every layer, no window, no cross-layer sharing, no YOCO, and none of the other kinds' sections
    (Gemma's `local` rings become global layers)."""
    att = dataclasses.replace(cfg.attention, n_kv_heads=cfg.attention.n_heads, window=None)
    sections = {kind.section: None for kind in KINDS.values() if kind.section is not None}
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}-mha",
        attention=att,
        kv_sharing=KVSharingConfig(),
        layer_pattern=("attention",),
        yoco=None,
        **sections,
    )

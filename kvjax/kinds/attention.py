"""Softmax attention layers: full-attention K/V (MHA, GQA, MQA) or, with a window, a sliding-window
ring (`swa`, also YOCO's self-decoder layers); per token 2 x n_kv_heads x head_dim values and an int32
position. Their K/V may serve later layers (CLA, MLKV, YOCO's cross-decoder)."""

import dataclasses

import jax.numpy as jnp

from kvjax.cache import KVCache, RingKVCache, layer_slots
from kvjax.errors import positive
from kvjax.kinds.base import INT32, Kind, LayerMemory, register


@dataclasses.dataclass(frozen=True)
class LocalAttentionConfig:
    """The `local` layers of `model.layer_pattern`: sliding-window attention over the last `window`
    positions (a ring of `window` slots) with their own RoPE base (None: model.attention.rope_theta), as
    Gemma 2 and 3 interleave local and global layers (Gemma 3: five local layers of 512 tokens, RoPE base
    10,000, per global layer of base 1,000,000). Heads and everything else are model.attention's."""

    window: int = 512
    rope_theta: float | None = None

    def __post_init__(self):
        positive("model.local", self, "window")
        positive("model.local", self, "rope_theta", optional=True)


class _Attention(Kind):
    shares_kv = True
    caches_tokens = True

    def init_cache(self, cfg, batch, capacity, fresh):
        att = cfg.attention_for(self.name)
        cls = KVCache if att.window is None else RingKVCache
        dtype = jnp.dtype(cfg.dtype)
        return cls.init(batch, layer_slots(att.window, capacity), att.n_kv_heads, att.head_dim, dtype).replace(
            fresh=fresh
        )

    def memory(self, cfg):
        att = cfg.attention_for(self.name)
        return LayerMemory(2 * att.n_kv_heads * att.head_dim * jnp.dtype(cfg.dtype).itemsize, INT32, INT32, att.window)

    def compressible(self, cfg):
        return cfg.attention_for(self.name).window is None  # a ring's memory is capped already

    def window(self, cfg):
        return cfg.attention_for(self.name).window

    def kv_heads(self, cfg):
        return cfg.attention_for(self.name).n_kv_heads


@register
class Attention(_Attention):
    name = "attention"


@register
class SlidingWindow(_Attention):
    """YOCO's self-decoder attention: `model.yoco.window` slots (a plain attention layer takes its
    window from `model.attention.window` instead)."""

    name = "swa"
    in_pattern = False


@register
class Local(_Attention):
    """Sliding-window attention placed by `model.layer_pattern` (Gemma's local layers): `model.local`'s
    window and RoPE base."""

    name = "local"
    section = "local"
    Config = LocalAttentionConfig

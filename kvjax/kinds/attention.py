"""Softmax attention layers: full-attention K/V (MHA, GQA, MQA) or, with a window, a sliding-window
ring (`swa`, also YOCO's self-decoder layers); per token 2 x n_kv_heads x head_dim values and an int32
position. Their K/V may serve later layers (CLA, MLKV, YOCO's cross-decoder)."""

import jax.numpy as jnp

from kvjax.cache import KVCache, RingKVCache, layer_slots
from kvjax.kinds.base import INT32, Kind, LayerMemory, register


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

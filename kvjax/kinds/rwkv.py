"""RWKV-7 (Peng et al. 2025): per sequence two token-shift inputs `[d_model]` (model dtype) and an fp32
WKV state of `d_model / head_size` heads of head_size^2; nothing per token."""

import jax.numpy as jnp

from kvjax.cache import RWKVState
from kvjax.kinds.base import Kind, LayerMemory, register


@register
class RWKV(Kind):
    name = "rwkv"

    def init_cache(self, cfg, batch, capacity, fresh):
        return RWKVState.init(batch, cfg.d_model, cfg.rwkv.head_size, jnp.dtype(cfg.dtype))

    def memory(self, cfg):
        shifts = 2 * cfg.d_model * jnp.dtype(cfg.dtype).itemsize
        return LayerMemory(0, 0, shifts + cfg.d_model * cfg.rwkv.head_size * 4, 0)

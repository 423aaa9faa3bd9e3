"""Mamba (Gu and Dao 2023): per sequence the last d_conv - 1 conv inputs of the inner width (model
dtype) and an fp32 `inner x d_state` SSM state; nothing per token."""

import jax.numpy as jnp

from kvjax.cache import SSMState
from kvjax.kinds.base import Kind, LayerMemory, register


@register
class Mamba(Kind):
    name = "mamba"

    def init_cache(self, cfg, batch, capacity, fresh):
        m = cfg.mamba
        return SSMState.init(batch, m.d_conv, m.expand * cfg.d_model, m.d_state, jnp.dtype(cfg.dtype))

    def memory(self, cfg):
        m, inner = cfg.mamba, cfg.mamba.expand * cfg.d_model
        return LayerMemory(0, 0, (m.d_conv - 1) * inner * jnp.dtype(cfg.dtype).itemsize + inner * m.d_state * 4, 0)

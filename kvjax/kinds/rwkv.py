"""RWKV-7 (Peng et al. 2025): per sequence two token-shift inputs `[d_model]` (model dtype) and an fp32
WKV state of `d_model / head_size` heads of head_size^2; nothing per token."""

import dataclasses

import jax.numpy as jnp

from kvjax.cache import RWKVState
from kvjax.errors import positive, require
from kvjax.kinds.base import Kind, LayerMemory, register

RWKV_FORMS = ("scan", "associative")


@dataclasses.dataclass(frozen=True)
class RWKVConfig:
    """RWKV-7 layers (Peng et al. 2025): heads of `head_size` channels (d_model must be a multiple);
    `form` is the training/prefill recurrence (`scan`: per token; `associative`: log depth). The channel
    mix is model.ffn_dim wide."""

    head_size: int = 16
    form: str = "scan"

    def __post_init__(self):
        positive("model.rwkv", self, "head_size")
        require(self.form in RWKV_FORMS, "model.rwkv.form", self.form, f"must be one of {RWKV_FORMS}")


@register
class RWKV(Kind):
    name = "rwkv"
    recurrent = True
    section = "rwkv"
    Config = RWKVConfig

    def init_cache(self, cfg, batch, capacity, fresh):
        return RWKVState.init(batch, cfg.d_model, cfg.rwkv.head_size, jnp.dtype(cfg.dtype))

    def memory(self, cfg):
        shifts = 2 * cfg.d_model * jnp.dtype(cfg.dtype).itemsize
        return LayerMemory(0, 0, shifts + cfg.d_model * cfg.rwkv.head_size * 4, 0)

"""Mamba (Gu and Dao 2023): per sequence the last d_conv - 1 conv inputs of the inner width (model
dtype) and an fp32 `inner x d_state` SSM state; nothing per token."""

import dataclasses

import jax.numpy as jnp

from kvjax.cache import SSMState
from kvjax.errors import positive, require
from kvjax.kinds.base import Kind, LayerMemory, register

MAMBA_SCANS = ("associative", "sequential")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Mamba-1 mixer (Gu and Dao 2023): state size `d_state`, conv kernel `d_conv`, inner width
    `expand` x d_model, Delta rank `dt_rank` (null: ceil(d_model / 16)), Delta initialised log-uniform in
    [dt_min, dt_max]; `scan` picks the training/prefill recurrence (associative: log depth)."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | None = None
    dt_min: float = 1e-3
    dt_max: float = 0.1
    scan: str = "associative"

    def __post_init__(self):
        p = "model.mamba"
        positive(p, self, "d_state", "d_conv", "expand")
        require(self.dt_rank is None or self.dt_rank > 0, f"{p}.dt_rank", self.dt_rank, "must be > 0 or null")
        require(
            0 < self.dt_min < self.dt_max,
            f"{p}.dt_min/dt_max",
            (self.dt_min, self.dt_max),
            "must satisfy 0 < dt_min < dt_max",
        )
        require(self.scan in MAMBA_SCANS, f"{p}.scan", self.scan, f"must be one of {MAMBA_SCANS}")


@register
class Mamba(Kind):
    name = "mamba"
    recurrent = True
    section = "mamba"
    Config = MambaConfig

    def init_cache(self, cfg, batch, capacity, fresh):
        m = cfg.mamba
        return SSMState.init(batch, m.d_conv, m.expand * cfg.d_model, m.d_state, jnp.dtype(cfg.dtype))

    def memory(self, cfg):
        m, inner = cfg.mamba, cfg.mamba.expand * cfg.d_model
        return LayerMemory(0, 0, (m.d_conv - 1) * inner * jnp.dtype(cfg.dtype).itemsize + inner * m.d_state * 4, 0)

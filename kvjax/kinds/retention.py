"""Retention layers: YOCO's gated retention (`gret`, sec. 2.2.2) and RetNet's multi-scale retention
(`retnet`, fixed decays, values `value_factor` times wider); their state is one fp32
`n_heads x head_dim x value_dim` matrix per sequence, nothing per token."""

import dataclasses

from kvjax.cache import RetentionState
from kvjax.errors import positive, require
from kvjax.kinds.base import Kind, LayerMemory, register

GRET_FORMS = ("parallel", "chunkwise", "recurrent")  # also YOCO's gated retention (model.yoco.gret_form)


@dataclasses.dataclass(frozen=True)
class RetNetConfig:
    """RetNet's multi-scale retention (Sun et al. 2023, arXiv 2307.08621): values `value_factor` x as wide
    as keys (per head), trained in `form` (parallel, chunkwise in chunks of `chunk` tokens, recurrent)."""

    value_factor: int = 2
    form: str = "chunkwise"
    chunk: int = 64

    def __post_init__(self):
        p = "model.retnet"
        positive(p, self, "value_factor", "chunk")
        require(self.form in GRET_FORMS, f"{p}.form", self.form, f"must be one of {GRET_FORMS}")


class _Retention(Kind):
    recurrent = True

    def value_dim(self, cfg) -> int:
        return cfg.attention.head_dim

    def init_cache(self, cfg, batch, capacity, fresh):
        att = cfg.attention
        return RetentionState.init(batch, att.n_heads, att.head_dim, self.value_dim(cfg))

    def memory(self, cfg):
        att = cfg.attention
        return LayerMemory(0, 0, att.n_heads * att.head_dim * self.value_dim(cfg) * 4, 0)


@register
class GatedRetention(_Retention):
    name = "gret"
    in_pattern = False  # YOCO's self-decoder places it


@register
class RetNet(_Retention):
    name = "retnet"
    section = "retnet"
    Config = RetNetConfig

    def value_dim(self, cfg):
        return cfg.retnet.value_factor * cfg.attention.head_dim

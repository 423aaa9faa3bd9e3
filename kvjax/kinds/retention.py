"""Retention layers: YOCO's gated retention (`gret`, sec. 2.2.2) and RetNet's multi-scale retention
(`retnet`, fixed decays, values `value_factor` times wider); their state is one fp32
`n_heads x head_dim x value_dim` matrix per sequence, nothing per token."""

from kvjax.cache import RetentionState
from kvjax.kinds.base import Kind, LayerMemory, register


class _Retention(Kind):
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

    def value_dim(self, cfg):
        return cfg.retnet.value_factor * cfg.attention.head_dim

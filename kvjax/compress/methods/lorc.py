"""LoRC (Zhang et al. 2024, "LoRC: Low-Rank Compression for LLMs KV Cache with a Progressive
Compression Strategy"): Palu's latent cache with bases from the K/V projection weights themselves (a
truncated SVD) and progressive ranks per layer; no calibration data (`kvjax.quant.lowrank`)."""

from kvjax.compress.methods.base import register
from kvjax.compress.methods.palu import Palu
from kvjax.config import ConfigError
from kvjax.quant.lowrank import lorc_bases


@register
class LoRC(Palu):  # Palu's latent cache; only where the bases come from differs
    name = "lorc"
    needs_calibration = False

    def check(self, stage, cfg):
        super().check(stage, cfg)
        if cfg.attention.qk_norm:  # a normed key is not in the span of W_k's rows
            raise ConfigError(
                f"policy stage 'lorc': {cfg.name!r} normalizes its keys (model.attention.qk_norm), so the "
                "key space is not W_k's; use palu, whose bases come from the keys themselves"
            )

    def prepare(self, stage, model, caches, calibration=None, shapes_only=False):
        # each layer's rank comes from its weights' condition numbers, so the sizes need the bases too
        return {"bases": lorc_bases(model, caches, stage.ratio, stage.options.heads)}

    def rank(self, stage, target, group_dim):
        return target.bases[0].shape[-1]  # progressive: each layer's own rank, from its bases

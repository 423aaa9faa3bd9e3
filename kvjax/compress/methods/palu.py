"""Palu (Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank Projection"): every token kept as
a rank-r latent of its pre-RoPE key and its value per group of heads (`kvjax.quant.lowrank`). Its
bases are the top eigenvectors of the K and V covariances of calibration tokens, computed once."""

from kvjax.compress.methods.base import Method, register
from kvjax.config import ConfigError
from kvjax.plan import compressible
from kvjax.quant.lowrank import LowRankKVCache, calibrate


@register
class Palu(Method):
    name = "palu"
    kind = "low_rank"
    prepares = ("bases",)
    needs_calibration = True

    def prepare(self, stage, model, calibration=None, shapes_only=False):
        if shapes_only:  # the latents' sizes follow from the ratio alone
            return {"bases": ()}
        if calibration is None:
            raise ConfigError("policy stage 'palu' needs calibration data: Generator(..., calibration=tokens)")
        return {"bases": calibrate(model, calibration, compressible(model.config), stage.ratio, stage.heads)}

    def encode(self, stage, cache, stat, target):
        return LowRankKVCache.from_cache(cache, *target.bases, target.capacity, target.rope_theta)

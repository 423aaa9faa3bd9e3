"""Palu (Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank Projection"): every token kept as
a rank-r latent of its pre-RoPE key and its value per group of heads (`kvjax.quant.lowrank`). Its
bases are the top eigenvectors of the K and V covariances of calibration tokens, computed once."""

import dataclasses

from kvjax.compress.methods.base import Method, Options, register
from kvjax.config import ConfigError
from kvjax.kinds import INT32
from kvjax.quant.lowrank import LowRankKVCache, calibrate, group_heads, rank_for


@register
class Palu(Method):
    name = "palu"
    pageable = True  # its latents, in latent pages (`kvjax.paged_lowrank`)
    poolable = False
    kind = "low_rank"
    prepares = ("bases",)
    needs_calibration = True

    @dataclasses.dataclass(frozen=True)
    class Options(Options):
        heads: int = 4  # KV heads per low-rank group

        def check(self, where):
            self.at_least_one(where, "heads")

    def check(self, stage, cfg):
        if cfg.attention.rope_scaling is not None:  # its latents are re-rotated with plain RoPE
            raise ConfigError(
                f"policy stage {stage.method!r}: {cfg.name!r} scales its RoPE frequencies (model.attention."
                "rope_scaling); re-rotating pre-RoPE latents with scaled RoPE is not implemented"
            )

    def validate(self, stage, where):
        if stage.ratio is None:
            raise ConfigError(f"{where}: give the fraction of K/V dimensions removed, a ratio in [0, 1)")

    def prepare(self, stage, model, caches, calibration=None, shapes_only=False):
        if shapes_only:  # the latents' sizes follow from the ratio alone
            return {"bases": ()}
        if calibration is None:
            raise ConfigError("policy stage 'palu' needs calibration data: Generator(..., calibration=tokens)")
        return {"bases": calibrate(model, calibration, caches, stage.ratio, stage.options.heads)}

    def encode(self, stage, cache, stat, target):
        return LowRankKVCache.from_cache(cache, *target.bases, target.capacity, target.rope_theta)

    def rank(self, stage, target, group_dim: int) -> int:
        """Latent dims per head group and K or V: what removes `ratio` of the group's bytes."""
        return rank_for(stage.ratio, group_dim)

    def cache_bytes(self, stage, target, mem, K, item, positions, source):
        head_dim = mem.kv_bytes_per_slot // (2 * K * item)
        g = group_heads(K, stage.options.heads)
        latent = 2 * (K // g) * self.rank(stage, target, g * head_dim) * item  # K and V latents per slot
        return target.capacity * (latent + INT32 * positions) + mem.bytes_per_sequence

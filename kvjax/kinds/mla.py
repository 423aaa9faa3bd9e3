"""Multi-head latent attention (DeepSeek-V2, sec. 2.1.2): per token only the normalized latent c_KV and
the RoPE key(s), `(kv_lora_rank + rope_heads x qk_rope_head_dim)` values and an int32 position; the one
latent serves every head."""

import jax.numpy as jnp

from kvjax.cache import LatentCache
from kvjax.kinds.base import INT32, Kind, LayerMemory, register


@register
class MLA(Kind):
    name = "mla"
    caches_tokens = True

    def init_cache(self, cfg, batch, capacity, fresh):
        mla = cfg.mla
        return LatentCache.init(
            batch, capacity, mla.kv_lora_rank, mla.rope_heads * mla.qk_rope_head_dim, jnp.dtype(cfg.dtype)
        )

    def memory(self, cfg):
        mla = cfg.mla
        per_token = (mla.kv_lora_rank + mla.rope_heads * mla.qk_rope_head_dim) * jnp.dtype(cfg.dtype).itemsize
        return LayerMemory(per_token, INT32, INT32, None)

    def compressible(self, cfg):
        return True

    def kv_heads(self, cfg):
        return 1

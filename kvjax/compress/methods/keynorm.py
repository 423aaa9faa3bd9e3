"""Key norm (Devoto et al. 2024, arXiv 2406.11430): keys with a low L2 norm draw attention, so the lowest
norms are kept (score = -||k||); no attention is observed."""

import jax.numpy as jnp

from kvjax.cache import LatentCache, PooledKVCache
from kvjax.compress.methods.base import Method, register


@register
class KeyNorm(Method):
    name = "keynorm"
    head_keys = True
    pageable = True
    per_head = True

    def score(self, stage, cache, stat, last_pos):
        if isinstance(cache, LatentCache):
            raise ValueError("keynorm scores per-head keys; an MLA cache stores a latent, not keys")
        k = cache.k[:, None] if isinstance(cache, PooledKVCache) else cache.k
        return -jnp.linalg.norm(k.astype(jnp.float32), axis=-1)

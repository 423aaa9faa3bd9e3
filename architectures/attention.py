"""Causal self-attention with n_heads queries and n_kv_heads keys/values: MHA, GQA (Ainslie et al. 2023)
and MQA (Shazeer 2019) are settings of one module; `window` makes it sliding-window attention."""

from __future__ import annotations

import jax
from flax import nnx

from architectures.layers import apply_rope, dense
from kvjax.cache import AttentionCache, heads_first
from kvjax.config import AttentionConfig
from kvjax.ops import attention


class Attention(nnx.Module):
    def __init__(self, d_model: int, cfg: AttentionConfig, *, std: float, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = dense(d_model, N * H, std=std, dtype=dtype, rngs=rngs)
        self.k = dense(d_model, K * H, std=std, dtype=dtype, rngs=rngs)
        self.v = dense(d_model, K * H, std=std, dtype=dtype, rngs=rngs)
        self.o = dense(N * H, d_model, std=std, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: AttentionCache | None = None
    ) -> tuple[jax.Array, AttentionCache | None]:
        """x `[B,T,D]` at positions `[B,T]` (-1 for padding); with a cache, K/V are written to it and
        the queries attend to what the cache says they see. Returns the output and the updated cache."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = apply_rope(self.q(x).reshape(B, T, cfg.n_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(self.k(x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = self.v(x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cache is None:
            k_all, v_all, k_pos = heads_first(k), heads_first(v), positions
        else:
            cache, (k_all, v_all, k_pos) = cache.update(k, v, positions)
        out = attention(q, k_all, v_all, positions, k_pos, window=cfg.window, impl=cfg.impl)
        return self.o(out.reshape(B, T, cfg.n_heads * cfg.head_dim)), cache

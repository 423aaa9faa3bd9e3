"""The decoder-only LM, built layer by layer from the model's `LayerPlan`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from architectures.attention import Attention
from architectures.layers import RMSNorm, SwiGLU, dense
from kvjax.cache import AttentionCache
from kvjax.config import ModelConfig
from kvjax.plan import LayerPlan

Caches = tuple[AttentionCache, ...]


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.mixer = Attention(cfg.d_model, cfg.attention, std=cfg.init_std, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, std=cfg.init_std, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache):
        y, cache = self.mixer(self.mixer_norm(x), positions, cache)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nnx.Module):
    """tokens `[B,T]` -> logits `[B,T,V]` (fp32), threading one cache per producer layer of the plan."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.plan = LayerPlan.from_config(cfg)
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(cfg.init_std),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else dense(cfg.d_model, cfg.vocab_size, std=cfg.init_std, dtype=dtype, rngs=rngs)
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, caches: Caches | None = None
    ) -> tuple[jax.Array, Caches | None]:
        """Logits for tokens `[B,T]` at positions `[B,T]` (-1 marks padding), and the updated caches."""
        hidden, caches = self.hidden(tokens, positions, caches)
        return self.logits(hidden), caches

    def hidden(self, tokens, positions, caches=None):
        """Final-normed hidden states `[B,T,D]` (before the vocabulary projection) and the caches."""
        return self.run_blocks(self.embed(tokens), positions, caches)

    def run_blocks(self, x, positions, caches=None):
        """The blocks and the final norm over embeddings x `[B,T,D]`; returns (hidden, caches)."""
        if caches is None:
            for block in self.blocks:
                x, _ = block(x, positions, None)
            return self.final_norm(x), None
        if len(caches) != len(self.plan.producers):
            raise ValueError(f"got {len(caches)} caches; the plan has {len(self.plan.producers)} producers")
        caches = list(caches)
        for i, block in enumerate(self.blocks):
            slot = self.plan.cache_index(i)
            x, caches[slot] = block(x, positions, caches[slot])
        return self.final_norm(x), tuple(caches)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden states to fp32 vocabulary logits (through the tied embedding if configured)."""
        if self.lm_head is None:
            table = self.embed.embedding[...]
            return jnp.einsum("...D,VD->...V", hidden, table, preferred_element_type=jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

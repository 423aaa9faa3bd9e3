"""The decoder-only LM, built layer by layer from the model's `LayerPlan`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from architectures.attention import Attention
from architectures.layers import RMSNorm, SwiGLU, dense
from architectures.mla import MLA
from kvjax.cache import AttentionCache
from kvjax.config import ModelConfig
from kvjax.plan import LayerPlan

Caches = tuple[AttentionCache, ...]


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    A K/V-producing block of a model with `kv_sharing.uses_kv_norm` feeds its K/V projections through a
    separate `kv_norm` of x (CLA), since those K/V also serve the layers that share them.
    """

    def __init__(self, cfg: ModelConfig, *, kind: str, produces_kv: bool, rngs: nnx.Rngs):
        dtype, std = jnp.dtype(cfg.dtype), cfg.init_std
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        use_kv_norm = produces_kv and cfg.kv_sharing.uses_kv_norm
        self.kv_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype) if use_kv_norm else None
        if kind == "mla":
            self.mixer = MLA(cfg.d_model, cfg.attention, cfg.mla, norm_eps=cfg.norm_eps, std=std, dtype=dtype, rngs=rngs)
        else:
            self.mixer = Attention(cfg.d_model, cfg.attention, produces_kv=produces_kv, std=std, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, std=std, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache=None, *, shared=None):
        """Returns (x, cache, view): the mixer's updated cache and the K/V view it attended to."""
        sharing = {} if shared is None else {"shared": shared}
        if self.kv_norm is not None:
            sharing["kv_x"] = self.kv_norm(x)
        y, cache, view = self.mixer(self.mixer_norm(x), positions, cache, **sharing)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cache, view


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
        self.blocks = nnx.List(
            [
                Block(cfg, kind=kind, produces_kv=src == i, rngs=rngs)
                for i, (kind, src) in enumerate(zip(self.plan.mixers, self.plan.kv_source))
            ]
        )
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
        """The blocks and the final norm over embeddings x `[B,T,D]`; returns (hidden, caches).

        Producers write their cache (one per producer, in plan order); a consumer attends to the K/V view
        its producer attended to in this same call.
        """
        plan = self.plan
        if caches is not None and len(caches) != len(plan.producers):
            raise ValueError(f"got {len(caches)} caches; the plan has {len(plan.producers)} producers")
        new_caches = None if caches is None else list(caches)
        views = {}
        for i, block in enumerate(self.blocks):
            src = plan.kv_source[i]
            if src != i:
                x, _, _ = block(x, positions, shared=views[src])
                continue
            slot = plan.cache_index(i)
            cache = None if caches is None else caches[slot]
            x, cache, views[i] = block(x, positions, cache)
            if new_caches is not None:
                new_caches[slot] = cache
        return self.final_norm(x), None if new_caches is None else tuple(new_caches)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project hidden states to fp32 vocabulary logits (through the tied embedding if configured)."""
        if self.lm_head is None:
            table = self.embed.embedding[...]
            return jnp.einsum("...D,VD->...V", hidden, table, preferred_element_type=jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

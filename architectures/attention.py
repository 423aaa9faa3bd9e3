"""Causal self-attention with n_heads queries and n_kv_heads keys/values: MHA, GQA (Ainslie et al. 2023)
and MQA (Shazeer 2019) are settings of one module; `window` makes it sliding-window attention.

A layer either produces K/V (its own projections and cache) or consumes those of an earlier layer (CLA,
MLKV: only query and output projections; it attends to the producer's post-RoPE keys and stores nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.architectures.layers import RMSNorm, apply_rope, dense
from kvjax.architectures.mixers import common, register_mixer
from kvjax.cache import AttentionCache, KVView, QuestKVCache, heads_first
from kvjax.config import AttentionConfig
from kvjax.ops import attention, attention_probs


class Attention(nnx.Module):
    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        *,
        produces_kv: bool,
        std: float,
        dtype,
        rngs: nnx.Rngs,
        norm_eps: float,
        norm_offset: float = 0.0,
    ):
        self.cfg = cfg
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q = dense(d_model, N * H, std=std, dtype=dtype, rngs=rngs, bias=bias)
        self.k = dense(d_model, K * H, std=std, dtype=dtype, rngs=rngs, bias=bias) if produces_kv else None
        self.v = dense(d_model, K * H, std=std, dtype=dtype, rngs=rngs, bias=bias) if produces_kv else None
        self.o = dense(N * H, d_model, std=std, dtype=dtype, rngs=rngs)
        # QK-norm (Qwen3, Gemma 3): one RMSNorm over head_dim shared by the heads, before RoPE
        norm = lambda: RMSNorm(H, eps=norm_eps, dtype=dtype, offset=norm_offset)  # noqa: E731
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm and produces_kv else None

    @property
    def produces_kv(self) -> bool:
        return self.k is not None

    def kv(self, kv_x: jax.Array, positions: jax.Array, cache: AttentionCache | None = None):
        """K/V of inputs `[B,T,D]` at positions `[B,T]`, written to `cache` if given. Returns (cache, the
        view a chunk of queries at these positions attends to)."""
        cfg = self.cfg
        B, T, _ = kv_x.shape
        k = self.k(kv_x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        k = apply_rope(k if self.k_norm is None else self.k_norm(k), positions, cfg.rope_theta, cfg.rope_scaling)
        v = self.v(kv_x).reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cache is None:
            return None, KVView(heads_first(k), heads_first(v), positions, fresh=T)
        return cache.update(k, v, positions)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: AttentionCache | None = None,
        *,
        kv_x: jax.Array | None = None,
        shared: KVView | None = None,
    ) -> tuple[jax.Array, AttentionCache | None, KVView]:
        """Queries from x `[B,T,D]` at positions `[B,T]` (-1 for padding).

        Attends to `shared` when given (a consumer's producer view, or a view this layer already wrote);
        otherwise computes K/V from `kv_x` (default x) with `kv()`. Returns the output, the updated cache
        and the view attended to (for the layers that share it).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.queries(x, positions)
        if shared is None:
            if not self.produces_kv:
                raise ValueError("a layer without K/V projections attends to its producer's view: pass shared=")
            cache, shared = self.kv(x if kv_x is None else kv_x, positions, cache)
            if isinstance(cache, QuestKVCache) and T == 1:  # Quest: a decode query reads its best pages
                shared = cache.select(q, shared, positions, cfg.window)
            elif getattr(shared.reader, "select", None) is not None:  # the engine's Quest pages (`kvjax.paged_quest`)
                shared = shared._replace(reader=shared.reader.chosen(q, positions))
        if shared.reader is not None:  # the view attends its own way (kvjax.cache.KVView)
            out = shared.reader.attend(q, positions, self.cfg.impl, self.cfg.window, self.cfg.softcap)
        else:
            out = attention(
                q,
                shared.k,
                shared.v,
                positions,
                shared.pos,
                quant=shared.quant,
                paged=shared.paged,
                fresh=shared.fresh,
                **self._view_args(shared),
            )
        return self.o(out.reshape(B, T, cfg.n_heads * cfg.head_dim)), cache, shared

    def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Post-RoPE queries `[B,T,N,H]` of x `[B,T,D]`."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q(x).reshape(B, T, cfg.n_heads, cfg.head_dim)
        q = apply_rope(q if self.q_norm is None else self.q_norm(q), positions, cfg.rope_theta, cfg.rope_scaling)
        if cfg.query_scale is not None:  # attention scales by head_dim^-0.5; Gemma by query_scale^-0.5
            q = q * jnp.asarray((cfg.head_dim / cfg.query_scale) ** 0.5, q.dtype)
        return q

    def probs(self, x: jax.Array, positions: jax.Array, view: KVView) -> jax.Array:
        """Attention probabilities `[B,K,T,G,S]` of the queries of x `[B,T,D]` over `view`: what
        attention-based KV compressors score by (kvjax.compress)."""
        q = self.queries(x, positions)
        return attention_probs(q, view.k, view.v, positions, view.pos, **self._view_args(view))

    def _view_args(self, view: KVView) -> dict:
        cfg = self.cfg
        return dict(window=cfg.window, impl=cfg.impl, k_head=view.head, n_kv_heads=cfg.n_kv_heads, softcap=cfg.softcap)


def _build(kind: str):
    def build(cfg, layer, produces_kv, rngs):
        att = cfg.attention_for(kind)  # YOCO's `swa` layers take its window
        norms = dict(norm_eps=cfg.norm_eps, norm_offset=cfg.norm_offset)
        return Attention(cfg.d_model, att, produces_kv=produces_kv, rngs=rngs, **norms, **common(cfg))

    return build


register_mixer("attention", _build("attention"))
register_mixer("swa", _build("swa"))
register_mixer("local", _build("local"))

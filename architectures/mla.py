"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, sec. 2.1, eqs. 9-19).

Per token the cache holds only c_KV = RMSNorm(W_DKV h) (`kv_lora_rank` dims, eq. 9) and one RoPE key
k_R = RoPE(W_KR h) shared by every head (`qk_rope_head_dim` dims, eq. 15). Per head, keys are
[W_UK c_KV ; k_R] and values W_UV c_KV (eqs. 10-11, 17); queries are [q_C ; RoPE(q_R)], from h directly
or through a normed `q_lora_rank` latent (eqs. 12-13, 16); scores are scaled by 1/sqrt(d_nope + d_R).

Two equal ways to attend (`mla.absorb`):
- naive: expand per-head K/V from the cached latents, then ordinary attention;
- absorbed: fold W_UK into the query (q_C W_UK^T has `kv_lora_rank` dims per head) and W_UV into the
  output, and attend over the latent itself: an MQA with (d_c + d_R)-dim keys [c_KV ; k_R] and d_c-dim
  values c_KV, so per-head K/V of cached tokens are never built (sec. 2.1.2, "absorbed into W_Q / W_O").
W_UV is applied to the d_c-dim attention output per token rather than multiplied into W_O ahead of time:
the same product, and cheaper per decode step than a fresh `[N, d_c, D]` fold.

A model converted from MHA/GQA (MHA2MLA, `training.convert`) caches one RoPE key per source KV head
(`mla.rope_heads`) on a subset of each head's original frequencies (`mla.rope_pairs`); its query heads
read their group's key. Such a model attends through XLA (the Pallas kernels take one shared RoPE key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.architectures.layers import RMSNorm, apply_rope, dense
from kvjax.architectures.mixers import common, register_mixer
from kvjax.cache import LatentCache, LatentView, heads_first
from kvjax.config import AttentionConfig
from kvjax.kinds.mla import MLAConfig
from kvjax.ops import attend, attention, blocked_decode, decode_block, kernel_impl, masked_softmax
from kvjax.pallas_kernels import flash_attention, latent_decode_attention
from kvjax.rope import frequencies, rotate


class MLA(nnx.Module):
    def __init__(
        self,
        d_model: int,
        att: AttentionConfig,
        cfg: MLAConfig,
        *,
        norm_eps: float,
        std: float,
        dtype,
        rngs: nnx.Rngs,
        layer: int = 0,
    ):
        self.att, self.cfg, self.layer = att, cfg, layer
        N, qk_dim = att.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_down = dense(d_model, cfg.q_lora_rank, std=std, dtype=dtype, rngs=rngs)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=norm_eps, dtype=dtype)
            self.q_up = dense(cfg.q_lora_rank, N * qk_dim, std=std, dtype=dtype, rngs=rngs)
        else:
            self.q = dense(d_model, N * qk_dim, std=std, dtype=dtype, rngs=rngs)
        self.kv_down = dense(d_model, cfg.kv_lora_rank, std=std, dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=norm_eps, dtype=dtype) if cfg.latent_norm else None
        self.k_rope = dense(d_model, cfg.rope_heads * cfg.qk_rope_head_dim, std=std, dtype=dtype, rngs=rngs)
        self.k_up = dense(cfg.kv_lora_rank, N * cfg.qk_nope_head_dim, std=std, dtype=dtype, rngs=rngs)
        self.v_up = dense(cfg.kv_lora_rank, N * cfg.v_head_dim, std=std, dtype=dtype, rngs=rngs)
        self.o = dense(N * cfg.v_head_dim, d_model, std=std, dtype=dtype, rngs=rngs)

    @property
    def scale(self) -> float:
        return (self.cfg.qk_nope_head_dim + self.cfg.qk_rope_head_dim) ** -0.5

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: LatentCache | None = None
    ) -> tuple[jax.Array, LatentCache | None, LatentView]:
        """x `[B,T,D]` at positions `[B,T]` (-1 padding) -> (output, updated cache, the latent view)."""
        cfg, att = self.cfg, self.att
        B, T, _ = x.shape
        N = att.n_heads
        q_nope, q_rope = self.queries(x, positions)
        c = self.kv_down(x)
        c = c if self.kv_norm is None else self.kv_norm(c)
        k_rope = self.rope(self.k_rope(x).reshape(B, T, cfg.rope_heads, -1), positions).reshape(B, T, -1)
        if cache is None:
            view = LatentView(c, k_rope, positions)
        else:
            cache, view = cache.update(c, k_rope, positions)
        attend_fn = self._absorbed if cfg.absorb else self._naive
        if view.split is not None:  # a paged engine's mixed step (kvjax.paged.RowSplit)
            out = view.split.map(attend_fn, (q_nope, q_rope), positions)
        else:
            out = attend_fn(q_nope, q_rope, view, positions)  # [B,T,N,Dv]
        return self.o(out.reshape(B, T, N * cfg.v_head_dim)), cache, view

    def queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_C `[B,T,N,d_nope]`, RoPE'd q_R `[B,T,N,d_R]`) of x `[B,T,D]` (eqs. 12-14, 16)."""
        cfg, att = self.cfg, self.att
        B, T, _ = x.shape
        q = self.q_up(self.q_norm(self.q_down(x))) if cfg.q_lora_rank else self.q(x)
        q_nope, q_rope = jnp.split(q.reshape(B, T, att.n_heads, -1), [cfg.qk_nope_head_dim], axis=-1)
        return q_nope, self.rope(q_rope, positions)

    def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE of x `[B,T,heads,d_R]`, query heads or RoPE key heads: the standard d_R-dim frequencies, or
        (MHA2MLA) head h's own pairs of a head_dim-dim RoPE from `rope_pairs` (query head h those of key
        head h // (heads / rope_heads))."""
        pairs = self.cfg.rope_pairs
        if pairs is None:
            return apply_rope(x, positions, self.att.rope_theta)
        per_head = jnp.repeat(jnp.asarray(pairs[self.layer]), x.shape[2] // self.cfg.rope_heads, axis=0)
        inv_freq = frequencies(per_head, self.att.head_dim, self.att.rope_theta)[None, None]  # [1,1,heads,d_R/2]
        return rotate(x, positions[:, :, None], self.att.rope_theta, inv_freq)

    def probs(self, x: jax.Array, positions: jax.Array, view: LatentView) -> jax.Array:
        """Attention probabilities `[B,1,T,N,S]` of the queries of x over the latent view (one shared
        "KV head", as in the absorbed form; the naive form has the same probabilities)."""
        return self._latent_probs(*self.queries(x, positions), view, positions)

    def _latent_query(self, q_nope) -> jax.Array:
        """q_nope `[B,T,N,d]` with W_UK absorbed: `[B,T,N,Dc]`, to dot with the latents."""
        cfg = self.cfg
        w_uk = self.k_up.kernel[...].reshape(cfg.kv_lora_rank, q_nope.shape[2], cfg.qk_nope_head_dim)
        return jnp.einsum("BTNd,CNd->BTNC", q_nope, w_uk)

    def _latent_probs(self, q_nope, q_rope, view: LatentView, positions) -> jax.Array:
        q_latent = self._latent_query(q_nope)
        f32 = jnp.float32
        B, T, N, R = (*q_rope.shape[:3], self.cfg.rope_heads)
        rope_logits = jnp.einsum(
            "BTrgD,BSrD->BTrgS",
            q_rope.reshape(B, T, R, N // R, -1),
            view.k_rope.reshape(*view.k_rope.shape[:2], R, -1),
            preferred_element_type=f32,
        )
        logits = jnp.einsum("BTNC,BSC->BTNS", q_latent, view.c, preferred_element_type=f32) + rope_logits.reshape(
            B, T, N, -1
        )
        # One shared "KV head": the [B,1,T,N,S] layout of the attention op with K = 1, G = N.
        return masked_softmax(logits[:, None] * self.scale, positions, view.pos)

    def _naive(self, q_nope, q_rope, view: LatentView, positions) -> jax.Array:
        """Expand per-head keys and values from the latents, then standard attention."""
        cfg = self.cfg
        B, S, _ = view.c.shape
        N = q_nope.shape[2]
        k_nope = self.k_up(view.c).reshape(B, S, N, cfg.qk_nope_head_dim)
        k_rope = jnp.repeat(view.k_rope.reshape(B, S, cfg.rope_heads, -1), N // cfg.rope_heads, axis=2)  # [B,S,N,d_R]
        k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
        v = self.v_up(view.c).reshape(B, S, N, cfg.v_head_dim)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        return attention(q, heads_first(k), heads_first(v), positions, view.pos, scale=self.scale, impl=self.att.impl)

    def _absorbed(self, q_nope, q_rope, view: LatentView, positions) -> jax.Array:
        """Attend over the latents: W_UK moves into the query, W_UV onto the d_c-dim output."""
        cfg = self.cfg
        N = q_nope.shape[2]
        w_uv = self.v_up.kernel[...].reshape(cfg.kv_lora_rank, N, cfg.v_head_dim)
        shared_rope = cfg.rope_heads == 1  # one RoPE key for every head: the latent and it form one MQA head
        if kernel_impl(self.att.impl) == "pallas" and shared_rope:  # the kernels' one shared "KV head"
            out_latent = self._absorbed_kernel(q_nope, q_rope, view, positions)
            return jnp.einsum("BTNC,CNd->BTNd", out_latent.astype(view.c.dtype), w_uv).astype(q_nope.dtype)
        block = decode_block(view.c.shape[1]) if q_nope.shape[1] == 1 and shared_rope else None
        if block is not None:  # a decode step: kvjax.ops' blocked path, latent and RoPE logits summed
            # With one query per row, [B,T=1,N,.] is also the [B,K=1,G=N,.] of one shared latent "head".
            latents = view.c[:, None]
            parts = ((self._latent_query(q_nope), latents), (q_rope, view.k_rope[:, None]))
            out_latent = blocked_decode(parts, latents, positions, view.pos, None, self.scale, block).astype(
                latents.dtype
            )
        else:
            out_latent = attend(self._latent_probs(q_nope, q_rope, view, positions), view.c[:, None])  # [B,T,N,Dc]
        return jnp.einsum("BTNC,CNd->BTNd", out_latent, w_uv).astype(q_nope.dtype)

    def _absorbed_kernel(self, q_nope, q_rope, view: LatentView, positions) -> jax.Array:
        """The absorbed attention through Pallas: a decode step reads each latent block once for both
        logit parts and the values; a prefill runs flash attention over [latent, RoPE key] (a copy,
        worth it in a compute-bound prefill). Returns `[B,T,N,Dc]` fp32."""
        q_latent = self._latent_query(q_nope)
        if q_nope.shape[1] == 1:
            out = latent_decode_attention(
                q_latent[:, 0], q_rope[:, 0], view.c, view.k_rope, positions[:, 0], view.pos, scale=self.scale
            )
            return out[:, None]
        q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
        k = jnp.concatenate([view.c, view.k_rope.astype(view.c.dtype)], axis=-1)[:, None]
        return flash_attention(q, k, view.c[:, None], positions, view.pos, scale=self.scale)


def _build(cfg, layer, produces_kv, rngs):
    return MLA(cfg.d_model, cfg.attention, cfg.mla, norm_eps=cfg.norm_eps, rngs=rngs, layer=layer, **common(cfg))


register_mixer("mla", _build)

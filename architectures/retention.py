"""Gated retention (gRet), the efficient self-attention of YOCO's self-decoder (Sun et al. 2024,
arXiv 2405.05254, sec. 2.2.2, eqs. 5-8).

Per head, with a data-dependent decay gamma_n = exp(logsigmoid(x_n W_gamma) / 16):
    S_n = gamma_n S_{n-1} + k_n^T v_n,    o_n = q_n S_n,
with RoPE on q and k, k scaled by 1/sqrt(head_dim) (as the reference code does), each head's output
RMS-normed without a learned scale (the reference's `subln`), then gated: out = W_O (swish(x W_G) * o).
The same map has three forms that agree (DESIGN.md oracle 3): parallel (a T x T decay-masked product),
chunkwise (parallel inside chunks, recurrent across them) and recurrent (one step per token); decoding
uses the recurrent step on a `RetentionState` whose size does not depend on the sequence length.
Padding tokens (position -1) neither decay nor add to the state.

Deviation: RoPE uses kvjax's half-split channel pairing, not the reference's interleaved one (an
equivalent permutation of the q/k channels).

RetNet's multi-scale retention (Sun et al. 2023, arXiv 2307.08621, sec. 2.1-2.2) is the same map with
`decay="fixed"`: head h decays by gamma_h = 1 - 2^(-5-h) whatever the input (no gamma projection),
values are `value_factor` (2) times as wide as keys, and q, k rotate at angles n theta_i with
theta_i = 1 / base^(i / (H/2 - 1)) (torchscale's `RetNetRelPos`, base 10000: rope_theta). RetNet's
decay-matrix normalisation D~ and retention-score normalisation R~ (sec. 2.2) scale each query's row
of one head by a positive scalar, which the per-head norm that follows removes (up to its eps), so
they are left out and the three forms are exactly gated retention's; the block around it is kvjax's
(RMSNorm, SwiGLU MLP) rather than RetNet's LayerNorm and GELU FFN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.architectures.layers import apply_rope, dense
from kvjax.architectures.mixers import common, register_mixer
from kvjax.cache import RetentionState
from kvjax.rope import rotate

GATE_LOGIT_NORMALIZER = 16.0


def retention_recurrent(q, k, v, log_decay, s0):
    """One step per token: q, k, v `[B,T,N,H]`, log_decay `[B,T,N]` (<= 0), s0 `[B,N,H,H]` ->
    (o `[B,T,N,H]`, final state)."""

    def step(s, inputs):
        q_t, k_t, v_t, g_t = inputs  # [B,N,H] x3, [B,N]
        s = jnp.exp(g_t)[..., None, None] * s + jnp.einsum("BNk,BNv->BNkv", k_t, v_t)
        return s, jnp.einsum("BNk,BNkv->BNv", q_t, s)

    time_first = [jnp.moveaxis(a, 1, 0) for a in (q, k, v, log_decay)]
    s, o = jax.lax.scan(step, s0, time_first)
    return jnp.moveaxis(o, 0, 1), s


def _decay_matrix(cum: jax.Array) -> jax.Array:
    """exp(G_t - G_s) for s <= t, else 0, from cumulative log decays `[B,T,N]` -> `[B,N,T,S]`."""
    T = cum.shape[1]
    diff = cum.transpose(0, 2, 1)[:, :, :, None] - cum.transpose(0, 2, 1)[:, :, None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)


def retention_parallel(q, k, v, log_decay, s0):
    """o_t = sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s + exp(G_t) q_t S_0, with G the cumulative log decay."""
    cum = jnp.cumsum(log_decay, axis=1)  # [B,T,N]
    scores = jnp.einsum("BTNk,BSNk->BNTS", q, k) * _decay_matrix(cum)
    o = jnp.einsum("BNTS,BSNv->BTNv", scores, v)
    o = o + jnp.einsum("BTNk,BNkv->BTNv", q * jnp.exp(cum)[..., None], s0)
    k_to_end = k * jnp.exp(cum[:, -1:] - cum)[..., None]  # each key decayed to the last step
    s = jnp.exp(cum[:, -1])[..., None, None] * s0 + jnp.einsum("BTNk,BTNv->BNkv", k_to_end, v)
    return o, s


def retention_chunkwise(q, k, v, log_decay, s0, chunk: int):
    """The parallel form inside chunks of `chunk` tokens, the recurrence across them (T padded up to a
    multiple of `chunk` with tokens that neither decay nor contribute)."""
    B, T, N, H = q.shape
    pad = -T % chunk
    if pad:
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(a, widths) for a in (q, k, v))
        log_decay = jnp.pad(log_decay, widths[:3])
    n = (T + pad) // chunk

    def split(a):  # [B, n*C, ...] -> [n, B, C, ...]
        return jnp.moveaxis(a.reshape(B, n, chunk, *a.shape[2:]), 1, 0)

    def body(s, inputs):
        o, s = retention_parallel(*inputs, s)
        return s, o

    s, o = jax.lax.scan(body, s0, tuple(split(a) for a in (q, k, v, log_decay)))
    return jnp.moveaxis(o, 0, 1).reshape(B, n * chunk, N, v.shape[-1])[:, :T], s


def retnet_log_decay(n_heads: int) -> jax.Array:
    """log gamma_h of RetNet's heads, gamma_h = 1 - 2^(-5-h) `[N]`."""
    return jnp.log1p(-(2.0 ** (-5.0 - jnp.arange(n_heads, dtype=jnp.float32))))


def retnet_angles(head_dim: int, base: float) -> jax.Array:
    """RetNet's rotation frequencies theta_i = base^(-i / (H/2 - 1)), i < H/2 (torchscale `RetNetRelPos`)."""
    return base ** -jnp.linspace(0.0, 1.0, head_dim // 2)


class GatedRetention(nnx.Module):
    """Gated retention (`decay="gated"`, YOCO) or RetNet's multi-scale retention (`decay="fixed"`, with
    values `value_factor` times wider): see the module docstring."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        form: str,
        chunk: int,
        norm_eps: float,
        std: float,
        dtype,
        rngs: nnx.Rngs,
        decay: str = "gated",
        value_factor: int = 1,
    ):
        self.n_heads, self.head_dim, self.rope_theta = n_heads, head_dim, rope_theta
        self.form, self.chunk, self.norm_eps, self.decay = form, chunk, norm_eps, decay
        width, value_width = n_heads * head_dim, n_heads * head_dim * value_factor
        self.q = dense(d_model, width, std=std, dtype=dtype, rngs=rngs)
        self.k = dense(d_model, width, std=std, dtype=dtype, rngs=rngs)
        self.v = dense(d_model, value_width, std=std, dtype=dtype, rngs=rngs)
        self.g = dense(d_model, value_width, std=std, dtype=dtype, rngs=rngs)
        self.gamma = dense(d_model, n_heads, std=std, dtype=dtype, rngs=rngs) if decay == "gated" else None
        self.o = dense(value_width, d_model, std=std, dtype=dtype, rngs=rngs)

    def _rotate(self, x, positions):
        if self.decay == "gated":
            return apply_rope(x, positions, self.rope_theta)
        angles = retnet_angles(self.head_dim, self.rope_theta).reshape(1, 1, 1, -1)
        return rotate(x, positions[:, :, None], self.rope_theta, angles)

    def __call__(
        self, x: jax.Array, positions: jax.Array, state: RetentionState | None = None
    ) -> tuple[jax.Array, RetentionState | None, None]:
        """x `[B,T,D]` at positions `[B,T]` (-1 padding) -> (output, updated state, no K/V view)."""
        B, T, _ = x.shape
        N, H = self.n_heads, self.head_dim
        f32 = jnp.float32
        valid = (positions >= 0)[..., None]
        q = self._rotate(self.q(x).reshape(B, T, N, H), positions).astype(f32)
        k = self._rotate(self.k(x).reshape(B, T, N, H), positions).astype(f32) * H**-0.5
        k = jnp.where(valid[..., None], k, 0.0)
        v = self.v(x).reshape(B, T, N, -1).astype(f32)
        if self.gamma is None:  # RetNet: a fixed decay per head
            log_decay = jnp.where(valid, retnet_log_decay(N)[None, None, :], 0.0)
        else:
            log_decay = jnp.where(valid, jax.nn.log_sigmoid(self.gamma(x).astype(f32)) / GATE_LOGIT_NORMALIZER, 0.0)
        s0 = jnp.zeros((B, N, H, v.shape[-1]), f32) if state is None else state.s
        form = "recurrent" if T == 1 else self.form
        if form == "recurrent":
            o, s = retention_recurrent(q, k, v, log_decay, s0)
        elif form == "chunkwise":
            o, s = retention_chunkwise(q, k, v, log_decay, s0, self.chunk)
        else:
            o, s = retention_parallel(q, k, v, log_decay, s0)
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.norm_eps)  # per-head norm, no scale
        out = jax.nn.silu(self.g(x).astype(f32)) * o.reshape(B, T, -1)
        new_state = None if state is None else RetentionState(s=s)
        return self.o(out.astype(x.dtype)), new_state, None


def _build(cfg, form: str, chunk: int, rngs, **options):
    att = cfg.attention
    return GatedRetention(
        cfg.d_model,
        att.n_heads,
        att.head_dim,
        rope_theta=att.rope_theta,
        form=form,
        chunk=chunk,
        norm_eps=cfg.norm_eps,
        rngs=rngs,
        **options,
        **common(cfg),
    )


def _gated(cfg, layer, produces_kv, rngs):
    """YOCO's gated retention (its self-decoder's `gret` layers)."""
    return _build(cfg, cfg.yoco.gret_form, cfg.yoco.chunk, rngs)


def _retnet(cfg, layer, produces_kv, rngs):
    """RetNet's multi-scale retention: fixed decays, wider values."""
    ret = cfg.retnet
    return _build(cfg, ret.form, ret.chunk, rngs, decay="fixed", value_factor=ret.value_factor)


register_mixer("gret", _gated)
register_mixer("retnet", _retnet)

"""RWKV-7 "Goose" (Peng et al. 2025, arXiv 2503.14456) time mixing and channel mixing, following the
official reference (BlinkDL/RWKV-LM, RWKV-v7/rwkv_v7_numpy.py).

Time mixing, per token, with token shift x'_c = x + mu_c * (x_prev - x) for c in r, w, k, v, a, g:
    r = W_r x'_r,  k = W_k x'_k,  v = W_v x'_v
    w = exp(-sigmoid(tanh(x'_w A_w) B_w + w_0) / sqrt(e))          (data-dependent decay, in (0.545, 1))
    a = sigmoid(x'_a A_a B_a + a_0)                                 (in-context learning rate)
    g = sigmoid(x'_g A_g) B_g                                       (output gate)
    kk = normalize_per_head(k * k_k),  k = k * (1 + (a - 1) * k_a)
    S_t = S_{t-1} (diag(w) - kk^T (kk * a)) + v^T k                 (generalized delta rule, per head)
    y = GroupNorm_per_head(S_t r) + (sum_head(r * k * r_k)) v;  out = W_o (y * g)
Channel mixing: out = W_v relu(W_k x'_k)^2 with its own token shift.

Two equal forms for training and prefill (`rwkv.form`): `scan` (one `lax.scan` step per token) and
`associative` (an associative scan over the per-token transitions (diag(w) - kk^T (kk a), v^T k), whose
composition is (M1 M2, U1 M2 + U2): log depth, O(T H^3)). Decoding steps the same recurrence on an
`RWKVState` (both token-shift inputs and S), constant in size. Padding tokens (position -1) get w = 1 and
kk = k = 0, so they leave S unchanged, and never become the token-shift input.

Simplifications, all documented: RMSNorm instead of LayerNorm around the block (as every kvjax layer),
no extra LayerNorm after the embedding (the reference's ln0), and no value residual from layer 0 (the
reference's v_first), so that an RWKV layer is a self-contained mixer of the layer plan. The token-shift
mixes and the decay bias use the reference's per-channel initialisation; LoRA down-projections start at
zero (as in the reference), other matrices at the model's normal init.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.architectures.layers import dense, last_valid
from kvjax.architectures.mixers import common, register_mixer
from kvjax.cache import RWKVState
from kvjax.kinds.rwkv import RWKVConfig

GROUP_NORM_EPS = 64e-5  # the reference's 1e-5 * head_size_divisor**2


def _shifted(x: jax.Array, prev: jax.Array) -> jax.Array:
    """x_{t-1} for every t of x `[B,T,D]`, with `prev` `[B,D]` before the first."""
    return jnp.concatenate([prev[:, None].astype(x.dtype), x[:, :-1]], axis=1)


def wkv_scan(r, w, k, v, kk, a, s0):
    """y_t = S_t r_t with S_t = S_{t-1} (diag(w_t) - kk_t^T (kk_t a_t)) + v_t^T k_t; all `[B,T,N,H]`,
    S `[B,N,H,H]` (value index first). Returns (y, final S)."""

    def step(s, xs):
        r_t, w_t, k_t, v_t, kk_t, a_t = xs
        s = s * w_t[:, :, None, :] - jnp.einsum("BNvk,BNk,BNj->BNvj", s, kk_t, kk_t * a_t)
        s = s + jnp.einsum("BNv,BNk->BNvk", v_t, k_t)
        return s, jnp.einsum("BNvk,BNk->BNv", s, r_t)

    s, y = jax.lax.scan(step, s0, tuple(jnp.moveaxis(t, 1, 0) for t in (r, w, k, v, kk, a)))
    return jnp.moveaxis(y, 0, 1), s


def wkv_associative(r, w, k, v, kk, a, s0):
    """The same map in log depth: prefix products of the transitions (M_t, U_t), then S_t = S_0 M_1..t + U_1..t."""
    H = r.shape[-1]
    m = jnp.eye(H)[None, None, None] * w[..., None, :] - kk[..., :, None] * (kk * a)[..., None, :]  # [B,T,N,k,j]
    u = v[..., :, None] * k[..., None, :]  # [B,T,N,v,k]

    def combine(first, second):
        m1, u1 = first
        m2, u2 = second
        return jnp.einsum("...ij,...jk->...ik", m1, m2), jnp.einsum("...ij,...jk->...ik", u1, m2) + u2

    m_all, u_all = jax.lax.associative_scan(combine, (m, u), axis=1)
    s = jnp.einsum("BNvk,BTNkj->BTNvj", s0, m_all) + u_all
    return jnp.einsum("BTNvk,BTNk->BTNv", s, r), s[:, -1]


WKV_FORMS = {"scan": wkv_scan, "associative": wkv_associative}


def _lora_dim(d_model: int, factor: float, power: float) -> int:
    """The reference's LoRA width: max(32, round(factor * d^power / 32) * 32)."""
    return max(32, round(factor * d_model**power / 32) * 32)


class RWKVTimeMix(nnx.Module):
    def __init__(self, d_model: int, cfg: RWKVConfig, *, layer: int, n_layers: int, std: float, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H = d_model, cfg.head_size
        ddd = jnp.arange(D, dtype=jnp.float32) / D
        fade = 1.0 - layer / n_layers  # the reference's ratio_1_to_almost0
        depth = layer / max(n_layers - 1, 1)  # ratio_0_to_1
        mix = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
        self.mu = nnx.Param(jnp.stack([1.0 - ddd ** (p * fade) for p in mix.values()]).astype(dtype))  # [6, D]
        n = jnp.arange(D, dtype=jnp.float32) / (D - 1)
        self.w0 = nnx.Param((-7 + 5 * n ** (0.85 + depth**0.5) + 0.5).astype(dtype))
        self.a0 = nnx.Param(jnp.zeros((D,), dtype))
        dw, da, dg = _lora_dim(D, 1.8, 0.5), _lora_dim(D, 1.8, 0.5), _lora_dim(D, 0.6, 0.8)
        self.w_down, self.a_down, self.g_down = (dense(D, r, std=std, dtype=dtype, rngs=rngs) for r in (dw, da, dg))
        for down in (self.w_down, self.a_down):
            down.kernel[...] = jnp.zeros_like(down.kernel[...])
        self.w_up, self.a_up, self.g_up = (dense(r, D, std=std, dtype=dtype, rngs=rngs) for r in (dw, da, dg))
        self.k_k = nnx.Param(jnp.full((D,), 0.85, dtype))
        self.k_a = nnx.Param(jnp.ones((D,), dtype))
        self.r_k = nnx.Param(jnp.zeros((D // H, H), dtype))
        self.r, self.k, self.v, self.o = (dense(D, D, std=std, dtype=dtype, rngs=rngs) for _ in range(4))
        self.ln_scale = nnx.Param(jnp.ones((D,), dtype))
        self.ln_bias = nnx.Param(jnp.zeros((D,), dtype))

    def __call__(self, x, positions, state: RWKVState | None = None):
        """x `[B,T,D]` (normed) at positions `[B,T]` -> (output, state with new S and time-shift input, None)."""
        B, T, D = x.shape
        H = self.cfg.head_size
        N = D // H
        f32 = jnp.float32
        valid = (positions >= 0)[..., None]
        prev = jnp.zeros((B, D), x.dtype) if state is None else state.att_shift
        mu = self.mu[...]
        xr, xw, xk, xv, xa, xg = (x + mu[i][None, None] * (_shifted(x, prev) - x) for i in range(6))
        r, k, v = self.r(xr).astype(f32), self.k(xk).astype(f32), self.v(xv).astype(f32)
        lw = jnp.tanh(self.w_down(xw)).astype(f32)
        w = jnp.exp(
            -jax.nn.sigmoid(self.w_up(lw.astype(x.dtype)).astype(f32) + self.w0[...][None, None]) / math.sqrt(math.e)
        )
        a = jax.nn.sigmoid(self.a_up(self.a_down(xa)).astype(f32) + self.a0[...][None, None])
        g = self.g_up(jax.nn.sigmoid(self.g_down(xg))).astype(f32)
        kk = k * self.k_k[...][None, None]
        k = k * (1 + (a - 1) * self.k_a[...][None, None])
        heads = lambda t: t.reshape(B, T, N, H)  # noqa: E731
        r, w, k, v, kk, a = map(heads, (r, w, k, v, kk, a))
        kk = kk / jnp.maximum(jnp.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
        w = jnp.where(valid[..., None], w, 1.0)  # padding leaves S unchanged
        k, kk = (jnp.where(valid[..., None], t, 0.0) for t in (k, kk))
        s0 = jnp.zeros((B, N, H, H), f32) if state is None else state.s
        form = "scan" if T == 1 else self.cfg.form
        y, s = WKV_FORMS[form](r, w, k, v, kk, a, s0)
        mean = y.mean(axis=-1, keepdims=True)
        var = ((y - mean) ** 2).mean(axis=-1, keepdims=True)
        y = ((y - mean) * jax.lax.rsqrt(var + GROUP_NORM_EPS)).reshape(B, T, D)
        y = y * self.ln_scale[...][None, None] + self.ln_bias[...][None, None]
        bonus = (r * k * self.r_k[...].astype(f32)[None, None]).sum(axis=-1, keepdims=True) * v
        out = self.o(((y + bonus.reshape(B, T, D)) * g).astype(x.dtype))
        if state is None:
            return out, None, None
        return out, state.replace(s=s, att_shift=last_valid(x, valid[..., 0], prev)), None


class RWKVChannelMix(nnx.Module):
    """out = W_v relu(W_k x'_k)^2, x'_k the token-shifted input (RWKV-7 has no receptance gate here)."""

    def __init__(self, d_model: int, ffn_dim: int, *, layer: int, n_layers: int, std: float, dtype, rngs: nnx.Rngs):
        ddd = jnp.arange(d_model, dtype=jnp.float32) / d_model
        self.mu_k = nnx.Param((1.0 - ddd ** ((1.0 - layer / n_layers) ** 4)).astype(dtype))
        self.key = dense(d_model, ffn_dim, std=std, dtype=dtype, rngs=rngs)
        self.value = dense(ffn_dim, d_model, std=std, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, state: RWKVState | None = None):
        prev = jnp.zeros(x.shape[::2], x.dtype) if state is None else state.ffn_shift
        xk = x + self.mu_k[...][None, None] * (_shifted(x, prev) - x)
        out = self.value(jnp.square(jax.nn.relu(self.key(xk))))
        if state is None:
            return out, None
        return out, state.replace(ffn_shift=last_valid(x, positions >= 0, prev).astype(state.ffn_shift.dtype))


def _time_mix(cfg, layer, produces_kv, rngs):
    return RWKVTimeMix(cfg.d_model, cfg.rwkv, layer=layer, n_layers=cfg.n_layers, rngs=rngs, **common(cfg))


def _channel_mix(cfg, layer, rngs):
    return RWKVChannelMix(cfg.d_model, cfg.ffn_dim, layer=layer, n_layers=cfg.n_layers, rngs=rngs, **common(cfg))


register_mixer("rwkv", _time_mix, mlp=_channel_mix)

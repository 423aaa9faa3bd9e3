"""The Mamba-1 block (Gu and Dao 2023, arXiv 2312.00752, sec. 3 and Algorithm 2).

x, z = in_proj(u) (expand E = expand x D); x = SiLU(causal depthwise conv1d(x), kernel d_conv);
Delta = softplus(dt_proj(x W_dt)) (rank dt_rank = ceil(D/16)), B = x W_B, C = x W_C (d_state N each);
h_t = exp(Delta_t A) h_{t-1} + Delta_t B_t x_t,  y_t = C_t h_t + D x_t  (A = -exp(A_log), diagonal);
out = out_proj(y * SiLU(z)).
Initialisation as the paper and reference code: A = -[1..N] per channel (S4D-real), D = 1, dt_proj's
bias the inverse softplus of Delta ~ logU[dt_min, dt_max] = [1e-3, 0.1].

Training and prefill run the recurrence with `jax.lax.associative_scan` over the pairs
(exp(Delta A), Delta B x), or, with `mamba.scan: sequential`, a `lax.scan` (equal to 1e-5); decoding
steps an `SSMState` (the last d_conv - 1 conv inputs and h), whose size does not depend on the sequence.
Prompts are right-padded (position -1): the state kept is h and the conv inputs at each row's last valid
token, so padding never reaches later tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.architectures.layers import dense, last_valid
from kvjax.architectures.mixers import common, register_mixer
from kvjax.cache import SSMState
from kvjax.kinds.mamba import MambaConfig


def ssm_scan_associative(a: jax.Array, b: jax.Array, h0: jax.Array) -> jax.Array:
    """All states h_t = a_t h_{t-1} + b_t for a, b `[B,T,E,N]` and h0 `[B,E,N]`, in log depth."""
    b = b.at[:, 0].add(a[:, 0] * h0)

    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    return jax.lax.associative_scan(combine, (a, b), axis=1)[1]


def ssm_scan_sequential(a: jax.Array, b: jax.Array, h0: jax.Array) -> jax.Array:
    """The same states, one step at a time with `lax.scan`."""

    def step(h, ab):
        h = ab[0] * h + ab[1]
        return h, h

    _, hs = jax.lax.scan(step, h0, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0)))
    return jnp.moveaxis(hs, 0, 1)


SCANS = {"associative": ssm_scan_associative, "sequential": ssm_scan_sequential}


def dt_rank(cfg: MambaConfig, d_model: int) -> int:
    return cfg.dt_rank or math.ceil(d_model / 16)


class Mamba(nnx.Module):
    def __init__(self, d_model: int, cfg: MambaConfig, *, std: float, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        E, N, R = cfg.expand * d_model, cfg.d_state, dt_rank(cfg, d_model)
        self.in_proj = dense(d_model, 2 * E, std=std, dtype=dtype, rngs=rngs)
        bound = cfg.d_conv**-0.5  # PyTorch Conv1d's default init, as in the reference
        self.conv_w = nnx.Param(jax.random.uniform(rngs.params(), (cfg.d_conv, E), dtype, -bound, bound))
        self.conv_b = nnx.Param(jax.random.uniform(rngs.params(), (E,), dtype, -bound, bound))
        self.x_proj = dense(E, R + 2 * N, std=std, dtype=dtype, rngs=rngs)
        self.dt_proj = dense(R, E, std=std, dtype=dtype, rngs=rngs)
        self.dt_proj.kernel[...] = jax.random.uniform(rngs.params(), (R, E), dtype, -(R**-0.5), R**-0.5)
        log_dt = jax.random.uniform(rngs.params(), (E,), jnp.float32, math.log(cfg.dt_min), math.log(cfg.dt_max))
        dt = jnp.exp(log_dt)
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(dtype))  # softplus^-1(dt)
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.float32), (E, N))))
        self.D = nnx.Param(jnp.ones((E,), jnp.float32))
        self.out_proj = dense(E, d_model, std=std, dtype=dtype, rngs=rngs)

    def __call__(
        self, u: jax.Array, positions: jax.Array, state: SSMState | None = None
    ) -> tuple[jax.Array, SSMState | None, None]:
        """u `[B,T,D]` at positions `[B,T]` (-1 padding, right-aligned) -> (output, updated state, no view)."""
        cfg = self.cfg
        Bsz, T, _ = u.shape
        E, N, R = cfg.expand * u.shape[-1], cfg.d_state, dt_rank(cfg, u.shape[-1])
        f32 = jnp.float32
        valid = positions >= 0
        x, z = jnp.split(self.in_proj(u), 2, axis=-1)
        buf = jnp.zeros((Bsz, cfg.d_conv - 1, E), x.dtype) if state is None else state.conv.astype(x.dtype)
        xs = jnp.concatenate([buf, x], axis=1)  # [B, K-1+T, E]
        w = self.conv_w[...]
        conv = sum(xs[:, i : i + T] * w[None, None, i] for i in range(cfg.d_conv)) + self.conv_b[...][None, None]
        x = jax.nn.silu(conv).astype(f32)
        dbc = self.x_proj(x.astype(u.dtype)).astype(f32)
        dt, Bm, Cm = jnp.split(dbc, [R, R + N], axis=-1)
        dt_bias = self.dt_bias[...].astype(f32)[None, None]
        delta = jax.nn.softplus(self.dt_proj(dt.astype(u.dtype)).astype(f32) + dt_bias)
        A = -jnp.exp(self.A_log[...])
        a = jnp.exp(delta[..., None] * A[None, None])  # [B,T,E,N]
        b = (delta * x)[..., None] * Bm[:, :, None, :]
        h0 = jnp.zeros((Bsz, E, N), f32) if state is None else state.h
        hs = SCANS[cfg.scan](a, b, h0)
        y = jnp.einsum("BTEN,BTN->BTE", hs, Cm) + x * self.D[...][None, None]
        out = self.out_proj((y * jax.nn.silu(z.astype(f32))).astype(u.dtype))
        if state is None:
            return out, None, None
        n_valid = valid.sum(axis=1)  # the new conv buffer ends at each row's last valid input
        take = n_valid[:, None] + jnp.arange(cfg.d_conv - 1)[None, :]
        conv_state = jnp.take_along_axis(xs, take[..., None], axis=1)
        return out, SSMState(conv=conv_state.astype(state.conv.dtype), h=last_valid(hs, valid, h0)), None


register_mixer("mamba", lambda cfg, layer, produces_kv, rngs: Mamba(cfg.d_model, cfg.mamba, rngs=rngs, **common(cfg)))

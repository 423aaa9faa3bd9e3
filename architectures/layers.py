"""Building blocks shared by every decoder: RMSNorm, rotary embeddings (`kvjax.rope`) and the gated MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.rope import apply_rope

__all__ = ["Dense", "GatedMLP", "RMSNorm", "apply_rope", "dense", "last_valid"]


class Dense(nnx.Module):
    """A projection x @ kernel (+ bias, zeros at init, when `bias`), kernel `[d_in, d_out]` ~ N(0, std),
    computing in the kernel's dtype.

    Leading axes are flattened into one before the matmul: XLA:CPU's weight gradient of a `[B,T,D]`
    dot (contracting B and T together) ran 3.5x slower than the same matmul on `[B*T, D]` (SwiGLU's
    backward at 16 x 256 x 128, timed once both ways; `scripts/bench_train.py` times the training step).
    """

    def __init__(self, d_in: int, d_out: int, *, std: float, dtype, rngs: nnx.Rngs, bias: bool = False):
        self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (d_in, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = x.reshape(-1, x.shape[-1]).astype(kernel.dtype) @ kernel
        if self.bias is not None:
            y = y + self.bias[...][None, :]
        return y.reshape(*x.shape[:-1], kernel.shape[1])


def dense(d_in: int, d_out: int, *, std: float, dtype, rngs: nnx.Rngs, bias: bool = False) -> Dense:
    """A `Dense` projection with N(0, std) weights in `dtype` (bias-free unless `bias`)."""
    return Dense(d_in, d_out, std=std, dtype=dtype, rngs=rngs, bias=bias)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale) (Zhang and Sennrich 2019), computed in fp32 and cast back. Gemma
    stores the scale less one (`offset` 1); the parameter starts where offset + scale is 1."""

    def __init__(self, dim: int, *, eps: float, dtype, offset: float = 0.0):
        self.eps, self.offset = eps, offset
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (normed * (self.offset + scale)).astype(x.dtype)


_ACTS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Shazeer 2020, eq. 6), GeGLU with the tanh
    approximation of GELU as Gemma uses it (`model.mlp_act`)."""

    def __init__(self, d_model: int, ffn_dim: int, *, std: float, dtype, rngs: nnx.Rngs, act: str = "silu"):
        self.act = act
        self.gate = dense(d_model, ffn_dim, std=std, dtype=dtype, rngs=rngs)
        self.up = dense(d_model, ffn_dim, std=std, dtype=dtype, rngs=rngs)
        self.down = dense(ffn_dim, d_model, std=std, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(_ACTS[self.act](self.gate(x)) * self.up(x))


def last_valid(x: jax.Array, valid: jax.Array, prev: jax.Array) -> jax.Array:
    """Each row's entry of x `[B,T,...]` at its last valid token (`valid` `[B,T]`, right-padded), or
    `prev` `[B,...]` for a row with none: what a recurrent layer carries to the next chunk."""
    n = valid.sum(axis=1)
    index = jnp.maximum(n - 1, 0).reshape(-1, *([1] * (x.ndim - 1)))
    last = jnp.take_along_axis(x, index, axis=1)[:, 0]
    return jnp.where((n > 0).reshape(-1, *([1] * (last.ndim - 1))), last, prev.astype(last.dtype))

"""The building blocks against independent references."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.architectures.layers import GatedMLP, RMSNorm, apply_rope


def test_rope_is_a_complex_rotation_of_channel_pairs():
    """Channel i pairs with i + H/2 (HF Llama layout): (x_i + j x_{i+H/2}) * exp(j * pos * theta^(-2i/H))."""
    B, T, N, H, theta = 2, 5, 3, 8, 500.0
    x = np.random.default_rng(0).normal(size=(B, T, N, H)).astype(np.float32)
    pos = np.array([[0, 1, 2, 7, 100], [3, 3, 9, 0, 41]], np.int32)
    z = x[..., : H // 2] + 1j * x[..., H // 2 :]
    freq = theta ** (-2 * np.arange(H // 2) / H)
    rotated = z * np.exp(1j * pos[:, :, None, None] * freq)
    expected = np.concatenate([rotated.real, rotated.imag], axis=-1)
    np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.asarray(pos), theta), expected, atol=2e-5)


def test_rope_scores_depend_only_on_relative_position():
    q, k = np.random.default_rng(1).normal(size=(2, 1, 1, 1, 16)).astype(np.float32)

    def score(m, n):
        rq = apply_rope(jnp.asarray(q), jnp.array([[m]]), 10_000.0)
        rk = apply_rope(jnp.asarray(k), jnp.array([[n]]), 10_000.0)
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(5, 2), score(103, 100), rtol=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_table_rope_is_the_exact_rotation_at_any_int32_position_and_inverts():
    """kvjax.rope.rotate_exact (the caches' re-rotation): float64 complex rotation within fp32 rounding
    at positions up to 2^31 - 1, where the fp32 product of `rotate` is off by a whole radian; a negative
    position rotates back."""
    from kvjax.rope import rotate, rotate_exact

    H, theta = 16, 10_000.0
    x = np.random.default_rng(3).normal(size=(2, 3, 5, H)).astype(np.float32)
    pos = np.array([[0, 1, 2047, 2048, 8191], [70_000, 4_194_305, 123_456_789, 2**31 - 1, 5]], np.int64)
    z = x[..., : H // 2] + 1j * x[..., H // 2 :]
    angle = np.mod(pos[:, None, :, None] * (theta ** (-2 * np.arange(H // 2) / H)), 2 * np.pi)
    rotated = z * np.exp(1j * angle)
    expected = np.concatenate([rotated.real, rotated.imag], axis=-1)
    got = jax.jit(rotate_exact, static_argnums=2)(jnp.asarray(x), jnp.asarray(pos[:, None], jnp.int32), theta)
    np.testing.assert_allclose(got, expected, atol=5e-6)
    fp32 = np.asarray(rotate(jnp.asarray(x), jnp.asarray(pos[:, None], jnp.int32), theta))
    assert np.abs(fp32 - expected).max() > 0.1  # what the table avoids
    back = rotate_exact(got, -jnp.asarray(pos[:, None], jnp.int32), theta)
    np.testing.assert_allclose(back, x, atol=5e-6)


def test_rmsnorm_and_swiglu_match_their_formulas():
    x = np.random.default_rng(2).normal(size=(3, 4, 8)).astype(np.float32)
    norm = RMSNorm(8, eps=1e-6, dtype=jnp.float32)
    norm.scale[...] = jnp.arange(1.0, 9.0)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * np.arange(1.0, 9.0)
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-6)

    mlp = GatedMLP(8, 12, std=0.5, dtype=jnp.float32, rngs=nnx.Rngs(0))
    g, u, d = (np.asarray(m.kernel[...]) for m in (mlp.gate, mlp.up, mlp.down))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(mlp(jnp.asarray(x)), (silu(x @ g) * (x @ u)) @ d, rtol=1e-4, atol=1e-5)
    assert jax.tree.leaves(nnx.state(mlp))  # has parameters

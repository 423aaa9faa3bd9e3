"""Flash attention in interpret mode equals its jnp reference, forward and gradients, and lowers (forward
and backward) for TPU and GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from tests.pallas_kernels.lowering import BACKEND, TARGETS, assert_lowers

SHAPES = {  # (tokens, query heads, KV heads, head dim) of a compare model's training step and SmolLM2's prefill
    "compare-gqa": (128, 8, 2, 16),
    "smollm2": (2048, 9, 3, 64),
}


def _inputs(seed, B=2, T=20, N=4, K=2, S=40, H=8, dtype=jnp.float32, per_head=False):
    """Row 0: T queries at the end of S keys (chunked prefill against a cache); row 1: a 5-token prompt
    in a padded batch (its other queries and keys are padding, position -1)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
    q_pos = np.stack([np.arange(S - T, S), np.where(np.arange(T) < 5, np.arange(T), -1)])
    k_pos = np.stack([np.arange(S), np.where(np.arange(S) < 5, np.arange(S), -1)])
    if per_head:
        k_pos = np.stack([np.where(rng.random(k_pos.shape) < 0.7, k_pos, -1) for _ in range(K)], axis=1)
    return q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)


def _loss(fn, window, q_pos, k_pos):
    def loss(q, k, v):
        out = fn(q, k, v, q_pos, k_pos, scale=0.3, window=window)
        return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum()

    return loss


@pytest.mark.parametrize("N, K, window", [(4, 4, None), (4, 2, 6), (4, 1, None)])  # MHA, GQA with a window, MQA
def test_forward_and_gradients_equal_the_reference(N, K, window):
    q, k, v, q_pos, k_pos = _inputs(0, N=N, K=K)
    kernel = functools.partial(flash_attention, backend=BACKEND)
    out = kernel(q, k, v, q_pos, k_pos, scale=0.3, window=window)
    np.testing.assert_allclose(
        out, flash_attention_reference(q, k, v, q_pos, k_pos, scale=0.3, window=window), atol=1e-5
    )
    np.testing.assert_array_equal(out[1, 5:], 0.0)  # padding queries see no key
    grads = jax.grad(_loss(kernel, window, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(_loss(flash_attention_reference, window, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_several_key_blocks_and_per_head_positions():
    """160 keys: two 128-slot blocks (the second padded), positions that differ per KV head."""
    q, k, v, q_pos, k_pos = _inputs(1, T=24, S=160, per_head=True)
    kernel = functools.partial(flash_attention, backend=BACKEND)
    np.testing.assert_allclose(
        kernel(q, k, v, q_pos, k_pos, scale=0.3), flash_attention_reference(q, k, v, q_pos, k_pos, scale=0.3), atol=1e-5
    )
    grads = jax.grad(_loss(kernel, None, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(_loss(flash_attention_reference, None, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_gradients_over_several_query_and_key_blocks():
    """MQA with 4 query heads over 80 tokens: 320 rows in three 128-row blocks, which the backward's key
    kernel walks (and skips where causal masking hides a whole block); 144 keys in two blocks."""
    q, k, v, q_pos, k_pos = _inputs(4, T=80, N=4, K=1, S=144)
    kernel = functools.partial(flash_attention, backend=BACKEND)
    grads = jax.grad(_loss(kernel, 30, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(_loss(flash_attention_reference, 30, q_pos, k_pos), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_bf16_within_tolerance_and_equal_to_kvjax_ops():
    from kvjax.ops import attention

    q, k, v, q_pos, k_pos = _inputs(2, dtype=jnp.bfloat16)
    out = flash_attention(q, k, v, q_pos, k_pos, scale=8**-0.5, backend=BACKEND)
    np.testing.assert_allclose(out, flash_attention_reference(q, k, v, q_pos, k_pos, scale=8**-0.5), atol=2e-2)
    xla = attention(*(x.astype(jnp.float32) for x in (q, k, v)), q_pos, k_pos)
    np.testing.assert_allclose(out, xla, atol=2e-2)


@TARGETS
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_backward_lower_for_tpu_and_gpu(platform, backend, marker, shape, dtype):
    T, N, K, H = SHAPES[shape]
    B = 2
    arrays = [
        ((B, T, N, H), dtype),
        ((B, K, T, H), dtype),
        ((B, K, T, H), dtype),
        ((B, T), jnp.int32),
        ((B, T), jnp.int32),
    ]
    f = functools.partial(flash_attention, scale=H**-0.5, backend=backend)
    grad = jax.grad(lambda q, k, v, a, b: f(q, k, v, a, b).sum(), argnums=(0, 1, 2))
    names = ("kvjax_flash_attention_dkdv", "kvjax_flash_attention_dq")  # the backward's Pallas kernels
    assert_lowers(grad, arrays, platform, marker, names)

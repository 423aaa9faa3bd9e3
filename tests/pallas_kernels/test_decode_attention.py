"""Flash-decoding (interpret mode, or lowering.BACKEND) equals its jnp reference and kvjax.ops; lowers for TPU, GPU."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.decode_attention import decode_attention, decode_attention_reference, latent_decode_attention
from tests.pallas_kernels.lowering import BACKEND, TARGETS, assert_lowers

SHAPES = {  # (query heads, KV heads, head dim, slots) of kvjax's compare models and SmolLM2
    "compare-gqa": (8, 2, 16, 512),
    "smollm2": (9, 3, 64, 8192),
}


def _inputs(seed, B=3, N=4, K=2, S=40, H=8, Hv=None, dtype=jnp.float32, per_head=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, K, N // K, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, K, S, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, K, S, Hv or H)), dtype)
    lengths = np.array([S, S // 2 + 1, 0][:B])  # a full row, a half-full one, a padding row
    pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1)
    if per_head:  # after head-wise eviction: each head keeps other slots
        pos = np.stack([np.where(rng.random(pos.shape) < 0.7, pos, -1) for _ in range(K)], axis=1)
    return q, k, v, jnp.asarray(lengths - 1, jnp.int32), jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("window", [None, 7])
def test_interpret_equals_the_reference(N, K, window):
    q, k, v, q_pos, k_pos = _inputs(0, N=N, K=K)  # 40 slots: not a multiple of the 16-slot block
    kw = dict(scale=0.3, window=window)
    out = decode_attention(q, k, v, q_pos, k_pos, backend=BACKEND, **kw)
    np.testing.assert_allclose(out, decode_attention_reference(q, k, v, q_pos, k_pos, **kw), atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # the padding row sees no key


def test_many_blocks_and_splits_per_head_positions_and_value_width():
    """160 slots in 16-slot blocks: 10 blocks over 2 splits; positions per head; values wider than keys."""
    q, k, v, q_pos, k_pos = _inputs(1, S=160, Hv=12, per_head=True)
    out = decode_attention(q, k, v, q_pos, k_pos, scale=0.25, backend=BACKEND, block=16)
    np.testing.assert_allclose(out, decode_attention_reference(q, k, v, q_pos, k_pos, scale=0.25), atol=1e-5)


def test_bf16_within_tolerance_and_equal_to_kvjax_ops():
    from kvjax.ops import attention

    q, k, v, q_pos, k_pos = _inputs(2, B=2, N=6, K=2, S=64, dtype=jnp.bfloat16)
    out = decode_attention(q, k, v, q_pos, k_pos, scale=8**-0.5, backend=BACKEND)
    ref = decode_attention_reference(q, k, v, q_pos, k_pos, scale=8**-0.5)
    np.testing.assert_allclose(out, ref, atol=2e-2)
    B, K, G, H = q.shape
    xla = attention(
        q.reshape(B, 1, K * G, H).astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        q_pos[:, None],
        k_pos,
    )
    np.testing.assert_allclose(out.reshape(B, 1, K * G, H), xla, atol=2e-2)


@TARGETS
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_gpu(platform, backend, marker, shape, dtype):
    N, K, H, S = SHAPES[shape]
    B = 2
    arrays = [
        ((B, K, N // K, H), dtype),
        ((B, K, S, H), dtype),
        ((B, K, S, H), dtype),
        ((B,), jnp.int32),
        ((B, S), jnp.int32),
    ]
    assert_lowers(functools.partial(decode_attention, scale=H**-0.5, backend=backend), arrays, platform, marker)


def _latent_inputs(seed, B=2, N=4, S=48, Dc=12, Dr=4):
    rng = np.random.default_rng(seed)
    arrays = [
        jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((B, N, Dc), (B, N, Dr), (B, S, Dc), (B, S, Dr))
    ]
    lengths = np.array([S - 5, 9])
    pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1)
    return (*arrays, jnp.asarray(lengths - 1, jnp.int32), jnp.asarray(pos, jnp.int32))


def test_mla_latent_decode_equals_attention_over_concatenated_keys():
    q_lat, q_rope, c, k_rope, q_pos, k_pos = _latent_inputs(3)
    out = latent_decode_attention(q_lat, q_rope, c, k_rope, q_pos, k_pos, scale=0.2, backend=BACKEND, block=16)
    q = jnp.concatenate([q_lat, q_rope], -1)[:, None]
    k = jnp.concatenate([c, k_rope], -1)[:, None]
    ref = decode_attention_reference(q, k, c[:, None], q_pos, k_pos, scale=0.2)[:, 0]
    np.testing.assert_allclose(out, ref, atol=1e-5)


@TARGETS
@pytest.mark.parametrize("N, Dc, Dr, S", [(8, 12, 4, 512), (16, 512, 64, 4096)])  # compare's mla; DeepSeek-V2's
def test_latent_decode_lowers_for_tpu_and_gpu(platform, backend, marker, N, Dc, Dr, S):
    B = 2
    arrays = [
        ((B, N, Dc), jnp.bfloat16),
        ((B, N, Dr), jnp.bfloat16),
        ((B, S, Dc), jnp.bfloat16),
        ((B, S, Dr), jnp.bfloat16),
        ((B,), jnp.int32),
        ((B, S), jnp.int32),
    ]
    fn = functools.partial(latent_decode_attention, scale=0.1, backend=backend)
    assert_lowers(fn, arrays, platform, marker, out_shape=(B, N, Dc))  # Triton pads Dc=12 to 16, and cuts it back

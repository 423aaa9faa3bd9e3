"""The fused dequantize-attend decode kernel (interpret mode) equals attention over the cache's
dequantized K/V, for every layout it takes, and lowers for TPU and GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.ops import attention
from kvjax.pallas_kernels.backend import default_backend
from kvjax.pallas_kernels.quant_decode_attention import check, quant_decode_partials
from kvjax.quant import QuantKVCache, QuantSpec
from kvjax.quant.cache import WindowQuantKVCache
from tests.pallas_kernels.lowering import TARGETS, assert_lowers

LAYOUTS = {  # per-token int (symmetric, min-max) and KIVI (per-channel keys, per-token value groups)
    "int:8": QuantSpec("int", 8),
    "int:4": QuantSpec("int", 4),
    "int:2:asym": QuantSpec("int", 2, asym=True),
    "kivi:2": QuantSpec("kivi", 2, group=16, residual=32),
    "kivi:4": QuantSpec("kivi", 4, group=16, residual=32),
}


TRITON = default_backend() == "triton"  # then heads of 64 (Triton's dots need 16-byte code planes)


def _cache(spec, seed, B=3, K=2, H=64 if TRITON else 16, T=70, capacity=96, lengths=(70, 41, 0), per_head=False):
    """A quantized cache after a prompt: a full row, a partial one and an empty (padding) row."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)) * 2, jnp.float32) for _ in range(2))
    pos = np.where(np.arange(T)[None] < np.array(lengths)[:, None], np.arange(T)[None], -1)
    cache, _ = QuantKVCache.init(spec, B, capacity, K, H, jnp.float32).update(k, v, jnp.asarray(pos, jnp.int32))
    if per_head:  # as after head-wise eviction: each head has lost other tokens
        keep = rng.random((B, K, cache.capacity)) < 0.7
        cache = cache.replace(pos=jnp.where(keep, cache.pos[:, None], -1))
    return cache, jnp.asarray([max(lengths) + 2, 45, -1], jnp.int32)[:B]


def _fused_and_reference(cache, q_pos, seed, G=3, window=None):
    K, H = cache.k_codes.shape[1], cache.head_dim
    q = jnp.asarray(np.random.default_rng(seed).normal(size=(q_pos.shape[0], 1, K * G, H)), jnp.float32)
    k, v = cache.dequantized()
    kw = dict(window=window, scale=0.3)
    want = attention(q, k, v, q_pos[:, None], cache.pos, **kw)
    got = attention(q, k, v, q_pos[:, None], cache.pos, impl="pallas", quant=cache.stored(), **kw)
    return got, want


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_interpret_equals_attention_over_the_dequantized_cache(layout):
    cache, q_pos = _cache(LAYOUTS[layout], 0)
    got, want = _fused_and_reference(cache, q_pos, 1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[2], 0.0)  # the padding row sees no key


@pytest.mark.parametrize("layout", ["int:4", "kivi:2"])
def test_per_head_positions_and_a_window(layout):
    cache, q_pos = _cache(LAYOUTS[layout], 2, per_head=True)
    got, want = _fused_and_reference(cache, q_pos, 3, window=20)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_value_groups_narrower_than_a_bit_plane_and_several_splits():
    """head_dim 64 at 4 bits: a 32-byte plane spans two 16-channel value groups (runs read apart), and
    256 slots in 16-token key groups give 16 blocks over 4 splits."""
    cache, q_pos = _cache(
        QuantSpec("kivi", 4, group=16, residual=32), 4, B=2, K=1, H=64, T=200, capacity=256, lengths=(200, 77)
    )
    got, want = _fused_and_reference(cache, q_pos, 5, G=2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_kivi_ring_that_wrapped_reads_the_same_through_the_kernel():
    """A KIVI ring (`WindowQuantKVCache`, what `local=true` leaves of a sliding window) 40 decode steps on:
    its 48 slots hold blocks flushed over older ones and a residual over older codes, and the kernel, reading
    the stored codes and the residual at their tokens' slots, equals attention over the dequantized view."""
    ring, _ = _cache(QuantSpec("kivi", 2, group=16, residual=32), 8, B=2, T=40, capacity=48, lengths=(40, 20))
    ring = WindowQuantKVCache.of(ring)
    rng, K = np.random.default_rng(9), ring.k_codes.shape[1]
    step = jax.jit(lambda c, k, v: c.update(k, v, c.length[:, None])[0])
    for _ in range(40):
        ring = step(ring, *(jnp.asarray(rng.normal(size=(2, 1, K, ring.head_dim)), jnp.float32) for _ in range(2)))
    assert ring.length.tolist() == [80, 60] and ring.n_quant.tolist() == [64, 32]  # wrapped, residuals of 16, 28
    got, want = _fused_and_reference(ring, ring.length, 10)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_kernel_reads_codes_not_the_dequantized_copy():
    """Zeroing the dequantized K/V handed to attention changes nothing: only the codes are read."""
    cache, q_pos = _cache(LAYOUTS["kivi:2"], 6)
    H = cache.head_dim
    q = jnp.asarray(np.random.default_rng(7).normal(size=(3, 1, 6, H)), jnp.float32)
    zeros = jnp.zeros((3, 2, cache.capacity, H))
    got = attention(q, zeros, zeros, q_pos[:, None], cache.pos, impl="pallas", quant=cache.stored())
    k, v = cache.dequantized()
    np.testing.assert_allclose(got, attention(q, k, v, q_pos[:, None], cache.pos), atol=1e-5)
    assert cache.replace(spec=QuantSpec("kvquant", 3)).stored() is None  # 3-bit codes: the dequantized view


def test_layouts_triton_cannot_take_are_refused_by_name():
    check(2, 64, 32, 32, backend="triton")  # SmolLM2's head_dim at 2 bits: 16-byte planes
    with pytest.raises(ValueError, match="Triton's smallest dot"):
        check(4, 16, None, 16, backend="triton")  # 8-byte planes
    with pytest.raises(ValueError, match="bits=3 must be one of"):
        check(3, 64, 32, 32)
    check(4, 16, None, 16, backend="interpret")


SHAPES = {  # (query heads, KV heads, head dim, slots): the compare models' and SmolLM2's
    "compare-gqa": (8, 2, 16, 512),
    "smollm2": (9, 3, 64, 8192),
}


@TARGETS
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", ["int:8", "int:4:asym", "kivi:2", "kivi:4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_gpu(platform, backend, marker, shape, layout, dtype):
    N, K, H, S = SHAPES[shape]
    method, bits = layout.split(":")[:2]
    bits, B, asym = int(bits), 2, method == "kivi" or layout.endswith("asym")
    key_group, value_group = (32, min(32, H)) if method == "kivi" else (None, H)
    W = H * bits // 8
    key_scales = (B, K, 1, S) if key_group is None else (B, K, S // key_group, H)
    value_scales = (B, K, H // value_group, S)
    arrays = [
        ((B, K, N // K, H), dtype),
        ((B, K, S, W), jnp.uint8),
        (key_scales, dtype),
        ((B, K, S, W), jnp.uint8),
        (value_scales, dtype),
        ((B,), jnp.int32),
        ((B, S), jnp.int32),
    ]
    if asym:
        arrays += [(key_scales, dtype), (value_scales, dtype)]

    def fn(q, k_codes, k_scale, v_codes, v_scale, q_pos, k_pos, k_zero=None, v_zero=None):
        return quant_decode_partials(
            q,
            k_codes,
            k_scale,
            k_zero,
            v_codes,
            v_scale,
            v_zero,
            q_pos,
            k_pos,
            bits=bits,
            key_group=key_group,
            value_group=value_group,
            scale=0.1,
            backend=backend,
        )

    try:
        check(bits, H, key_group, value_group, backend)
    except ValueError as refused:  # compare's 16-dim heads below 8 bits: Triton's dot is too small
        assert backend == "triton" and H == 16 and bits < 8, refused
        return
    assert_lowers(fn, arrays, platform, marker)

"""Measured bytes (`nbytes()` of real caches) equal the analytic bytes of kvjax.memory."""

import dataclasses

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import memory
from kvjax.cache import caches_nbytes
from kvjax.config import AttentionConfig, ModelConfig, load_config
from kvjax.plan import init_caches


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "mqa-half", "swa", "cla2", "mlkv-1"])
@pytest.mark.parametrize("capacity", [1, 63, 64, 65, 1000])
def test_shipped_configs_measured_equals_analytic(name, capacity):
    cfg = load_config(name).model
    assert caches_nbytes(init_caches(cfg, 3, capacity)) == memory.cache_bytes(cfg, capacity, batch=3)


def test_analytic_bytes_by_hand():
    gqa, swa = load_config("gqa").model, load_config("swa").model
    # 4 layers x (K and V: 2 x 2 heads x 16 dims x 4 bytes + int32 pos) per token, + int32 length per layer
    assert memory.kv_bytes_per_token(gqa) == 4 * 2 * 2 * 16 * 4 == 1024
    assert memory.cache_bytes(gqa, 4096) == 4 * (4096 * (256 + 4) + 4)
    assert memory.cache_bytes(swa, 4096) == memory.cache_bytes(swa, 64) == 4 * (64 * 260 + 4)
    assert memory.kv_bytes_per_token(memory.mha_reference(gqa)) == 4 * memory.kv_bytes_per_token(gqa)


@settings(max_examples=40, deadline=None)
@given(
    n_layers=st.integers(1, 5),
    n_kv_heads=st.sampled_from([1, 2, 3]),
    group=st.integers(1, 3),
    half_head=st.integers(1, 16),
    window=st.none() | st.integers(1, 50),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    capacity=st.integers(1, 120),
    batch=st.integers(1, 3),
)
def test_random_configs_measured_equals_analytic(
    n_layers, n_kv_heads, group, half_head, window, dtype, capacity, batch
):
    att = AttentionConfig(n_heads=n_kv_heads * group, n_kv_heads=n_kv_heads, head_dim=2 * half_head, window=window)
    cfg = ModelConfig(n_layers=n_layers, dtype=dtype, attention=att)
    caches = init_caches(cfg, batch, capacity)
    assert all(c.k.dtype == jnp.dtype(dtype) for c in caches)
    assert caches_nbytes(caches) == memory.cache_bytes(cfg, capacity, batch)


def test_bf16_halves_the_payload():
    cfg = load_config("gqa").model
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    assert 2 * memory.kv_bytes_per_token(bf16) == memory.kv_bytes_per_token(cfg)


@pytest.mark.parametrize("name", ["gqa", "swa", "cla2", "mlkv-1", "mla"])
def test_mha_reference_is_plain_mha_of_the_same_shape(name):
    ref = memory.mha_reference(load_config(name).model)
    assert memory.cache_bytes(ref, 4096) == memory.cache_bytes(load_config("mha").model, 4096)

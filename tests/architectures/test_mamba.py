"""Mamba-1 (Gu and Dao 2023) and the Mamba/attention hybrid: scans agree, cached == full, constant state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import memory
from kvjax.architectures.mamba import Mamba, ssm_scan_associative, ssm_scan_sequential
from kvjax.cache import KVCache, SSMState, caches_nbytes
from kvjax.config import ConfigError, load_config
from kvjax.kinds.mamba import MambaConfig
from kvjax.plan import init_caches
from tests.architectures.oracles import (
    assert_cached_decode_equals_full_forward,
    assert_finite_on_long_sequence,
    assert_ragged_prefill_continues_each_row,
    tokens_and_positions,
)


def test_associative_scan_equals_sequential_scan_equals_a_python_loop():
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.uniform(keys[0], (2, 9, 3, 4), minval=0.5, maxval=1.0)
    b = jax.random.normal(keys[1], (2, 9, 3, 4))
    h0 = jax.random.normal(keys[2], (2, 3, 4))
    h, loop = np.asarray(h0), []
    for t in range(9):
        h = np.asarray(a[:, t]) * h + np.asarray(b[:, t])
        loop.append(h)
    loop = np.stack(loop, axis=1)
    np.testing.assert_allclose(ssm_scan_sequential(a, b, h0), loop, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ssm_scan_associative(a, b, h0), loop, atol=1e-5, rtol=1e-5)


def test_initialisation_follows_the_paper():
    layer = Mamba(128, MambaConfig(), std=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
    A = -np.exp(np.asarray(layer.A_log[...]))
    np.testing.assert_allclose(A[0], -np.arange(1, 17), rtol=1e-6)  # S4D-real: A_n = -(n + 1)
    delta = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert delta.min() >= 1e-3 * 0.999 and delta.max() <= 0.1 * 1.001 and delta.shape == (256,)
    assert layer.dt_proj.kernel.shape == (8, 256) and layer.x_proj.kernel.shape == (256, 8 + 2 * 16)
    np.testing.assert_array_equal(layer.D[...], np.ones(256))


@pytest.mark.parametrize("variant", ["hybrid-mamba-attn"])  # mamba alone: tests/architectures/test_kinds.py
def test_cached_decode_equals_full_forward(make_model, variant):
    assert_cached_decode_equals_full_forward(*make_model(variant))


def test_ragged_chunked_prefill_equals_each_row_alone(make_model):
    """Padding never enters the conv buffer nor the state."""
    assert_ragged_prefill_continues_each_row(*make_model("mamba"))


def test_scan_choice_gives_the_same_model(make_model):
    cfg, assoc = make_model("mamba")
    _, seq = make_model("mamba", "model.mamba.scan=sequential")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(assoc(tokens, pos)[0], seq(tokens, pos)[0], atol=2e-5, rtol=1e-5)


def test_state_size_does_not_depend_on_the_sequence_and_bytes_are_exact():
    cfg = load_config("mamba").model
    short, long = init_caches(cfg, 2, 16), init_caches(cfg, 2, 100_000)
    assert caches_nbytes(short) == caches_nbytes(long) == memory.cache_bytes(cfg, 16, batch=2)
    assert all(isinstance(c, SSMState) for c in short) and memory.kv_bytes_per_token(cfg) == 0
    per_layer = 3 * 256 * 4 + 256 * 16 * 4  # conv buffer + h, fp32
    assert memory.state_bytes_per_sequence(cfg) == 4 * per_layer
    hybrid = load_config("hybrid-mamba-attn").model
    caches = init_caches(hybrid, 2, 300)
    assert [type(c) for c in caches] == [SSMState, SSMState, KVCache, SSMState]
    assert caches_nbytes(caches) == memory.cache_bytes(hybrid, 300, batch=2)


def test_outputs_stay_finite_on_4k_tokens(make_model):
    assert_finite_on_long_sequence(*make_model("hybrid-mamba-attn"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.mamba.d_state=0"], "model.mamba.d_state=0 must be > 0"),
        (["model.mamba.scan=parallel"], "model.mamba.scan='parallel' must be one of"),
        (["model.mamba.dt_min=0.5"], "model.mamba.dt_min/dt_max=(0.5, 0.1) must satisfy 0 < dt_min < dt_max"),
        (
            ["model.kv_sharing.kind=cla", "model.kv_sharing.factor=2"],
            "model.layer_pattern=['mamba'] must be ['attention']",
        ),
    ],
)
def test_invalid_settings_raise(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("mamba", overrides)
    assert message in str(info.value)


def test_batched_generation_equals_each_prompt_alone(make_model):
    """Prompts of different lengths (right-padded to one bucket) through Mamba states and a K/V cache."""
    from kvjax import DecodingConfig, Generator

    _, model = make_model("hybrid-mamba-attn")
    gen = Generator(model, capacity=32)
    prompts = [[5, 17, 3], list(range(40, 51)), [200, 1, 2, 3, 4, 9]]
    batch = gen(prompts, DecodingConfig(max_new_tokens=6))
    for row, prompt in enumerate(prompts):
        alone = gen([prompt], DecodingConfig(max_new_tokens=6))
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])

"""RWKV-7 (Peng et al. 2025): the WKV forms agree with the official per-token equations, cached == full,
padding never leaks, constant state."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import DecodingConfig, Generator, memory
from kvjax.architectures.rwkv import GROUP_NORM_EPS, RWKVTimeMix, wkv_associative, wkv_scan
from kvjax.cache import RWKVState, caches_nbytes
from kvjax.config import ConfigError, load_config
from kvjax.kinds.rwkv import RWKVConfig
from kvjax.plan import init_caches
from tests.architectures.oracles import (
    assert_cached_decode_equals_full_forward,
    assert_finite_on_long_sequence,
    assert_ragged_prefill_continues_each_row,
    tokens_and_positions,
)


def official_wkv(r, w, k, v, kk, a, s0):
    """RWKV-v7/rwkv_v7_numpy.py's update, token by token and head by head (S: value rows, key columns)."""
    r, w, k, v, kk, a, s = (np.asarray(t, np.float64) for t in (r, w, k, v, kk, a, s0))
    ys = np.zeros_like(v)
    for b in range(r.shape[0]):
        for n in range(r.shape[2]):
            S = s[b, n].copy()
            for t in range(r.shape[1]):
                col = lambda x: x[b, t, n][:, None]  # noqa: E731
                S = S * col(w).T - S @ col(kk) * (col(kk) * col(a)).T + col(v) * col(k).T
                ys[b, t, n] = (S @ col(r))[:, 0]
            s[b, n] = S
    return ys, s


def test_wkv_scan_and_associative_forms_equal_the_official_update():
    keys = jax.random.split(jax.random.key(0), 7)
    shape = (2, 7, 3, 4)
    r, k, v = (jax.random.normal(key, shape) for key in keys[:3])
    w = jax.random.uniform(keys[3], shape, minval=0.5, maxval=1.0)
    kk = jax.random.normal(keys[4], shape)
    kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    a = jax.nn.sigmoid(jax.random.normal(keys[5], shape))
    s0 = jax.random.normal(keys[6], (2, 3, 4, 4))
    y_ref, s_ref = official_wkv(r, w, k, v, kk, a, s0)
    for form in (wkv_scan, wkv_associative):
        y, s = form(r, w, k, v, kk, a, s0)
        np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)


def test_time_mixing_follows_the_official_equations():
    """One layer over a sequence against a numpy transcription of the reference's time_mixing."""
    D, H = 32, 8
    layer = RWKVTimeMix(D, RWKVConfig(head_size=H), layer=1, n_layers=3, std=0.3, dtype=jnp.float32, rngs=nnx.Rngs(1))
    for p in (layer.w_down, layer.a_down, layer.a0, layer.r_k):  # leave the zero init so every term is exercised
        target = p.kernel if hasattr(p, "kernel") else p
        target[...] = jax.random.normal(jax.random.key(2), target[...].shape) * 0.3
    x = jax.random.normal(jax.random.key(3), (1, 5, D))
    got, _, _ = layer(x, jnp.arange(5)[None])

    f = lambda m: np.asarray(m.kernel[...], np.float64)  # noqa: E731
    mu = np.asarray(layer.mu[...], np.float64)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    S = np.zeros((D // H, H, H))
    last = np.zeros(D)
    outs = []
    for t in range(5):
        xt = np.asarray(x[0, t], np.float64)
        xr, xw, xk, xv, xa, xg = (xt + mu[i] * (last - xt) for i in range(6))
        r, k, v = xr @ f(layer.r), xk @ f(layer.k), xv @ f(layer.v)
        w = np.exp(-sig(np.tanh(xw @ f(layer.w_down)) @ f(layer.w_up) + np.asarray(layer.w0[...])) / math.e**0.5)
        a = sig(xa @ f(layer.a_down) @ f(layer.a_up) + np.asarray(layer.a0[...]))
        g = sig(xg @ f(layer.g_down)) @ f(layer.g_up)
        kk = k * np.asarray(layer.k_k[...])
        k = k + k * (a - 1) * np.asarray(layer.k_a[...])
        r, w, k, v, kk, a = (z.reshape(D // H, H, 1) for z in (r, w, k, v, kk, a))
        kk = kk / np.maximum(np.linalg.norm(kk, axis=1, keepdims=True), 1e-12)
        S = S * w.transpose(0, 2, 1) - S @ kk * (kk * a).transpose(0, 2, 1) + v * k.transpose(0, 2, 1)
        y = S @ r
        y = ((y - y.mean(axis=1, keepdims=True)) / (y.var(axis=1, keepdims=True) + GROUP_NORM_EPS) ** 0.5).reshape(D)
        y = y * np.asarray(layer.ln_scale[...]) + np.asarray(layer.ln_bias[...])
        y = y + ((r * k * np.asarray(layer.r_k[...])[..., None]).sum(axis=1, keepdims=True) * v).reshape(D)
        outs.append((y * g) @ f(layer.o))
        last = xt
    np.testing.assert_allclose(got[0], np.stack(outs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("form", ["scan", "associative"])
def test_cached_decode_equals_full_forward(make_model, form):
    caches = assert_cached_decode_equals_full_forward(*make_model("rwkv7", f"model.rwkv.form={form}"))
    assert all(isinstance(c, RWKVState) for c in caches)


def test_forms_give_the_same_model(make_model):
    cfg, scan = make_model("rwkv7")
    _, assoc = make_model("rwkv7", "model.rwkv.form=associative")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(scan(tokens, pos)[0], assoc(tokens, pos)[0], atol=2e-5, rtol=1e-5)


def test_ragged_chunked_prefill_and_batched_generation(make_model):
    cfg, model = make_model("rwkv7")
    assert_ragged_prefill_continues_each_row(cfg, model)
    gen = Generator(model, capacity=32)
    prompts = [[5, 17, 3], list(range(40, 51))]
    batch = gen(prompts, DecodingConfig(max_new_tokens=5))
    for row, prompt in enumerate(prompts):
        np.testing.assert_array_equal(batch.tokens[row], gen([prompt], DecodingConfig(max_new_tokens=5)).tokens[0])


def test_state_is_constant_and_bytes_are_exact():
    cfg = load_config("rwkv7").model
    assert caches_nbytes(init_caches(cfg, 2, 16)) == caches_nbytes(init_caches(cfg, 2, 50_000))
    assert caches_nbytes(init_caches(cfg, 2, 16)) == memory.cache_bytes(cfg, 16, batch=2)
    assert memory.kv_bytes_per_token(cfg) == 0
    assert memory.state_bytes_per_sequence(cfg) == 4 * (2 * 128 * 4 + 8 * 16 * 16 * 4)


def test_outputs_stay_finite_on_4k_tokens(make_model):
    assert_finite_on_long_sequence(*make_model("rwkv7"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.rwkv.head_size=24"], "model.rwkv.head_size=24 must divide model.d_model=128"),
        (["model.rwkv.form=chunked"], "model.rwkv.form='chunked' must be one of ('scan', 'associative')"),
    ],
)
def test_invalid_settings_raise(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("rwkv7", overrides)
    assert message in str(info.value)

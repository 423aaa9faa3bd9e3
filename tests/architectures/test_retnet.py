"""RetNet (Sun et al. 2023): fixed multi-scale decays and rotation angles, wide values, the three forms
equal, cached decode == full forward, causal gradients, and a state whose bytes match the analytic ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import memory
from kvjax.architectures.retention import (
    retention_chunkwise,
    retention_parallel,
    retention_recurrent,
    retnet_angles,
    retnet_log_decay,
)
from kvjax.cache import RetentionState, caches_nbytes
from kvjax.config import ConfigError, load_config
from kvjax.plan import init_caches
from tests.architectures.oracles import (
    assert_cached_decode_equals_full_forward,
    assert_gradient_causal,
    assert_ragged_prefill_continues_each_row,
    tokens_and_positions,
)


def test_decays_and_angles_are_retnets():
    np.testing.assert_allclose(np.exp(retnet_log_decay(4)), [1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8], rtol=1e-6)
    np.testing.assert_allclose(retnet_angles(8, 10_000.0), 1 / 10_000.0 ** np.linspace(0, 1, 4), rtol=1e-6)


@pytest.mark.parametrize("T_, chunk", [(17, 5), (16, 4)])
def test_forms_agree_with_wide_values_and_fixed_decay(T_, chunk):
    keys = jax.random.split(jax.random.key(3), 4)
    N, H = 3, 4
    q, k = (jax.random.normal(key, (2, T_, N, H)) for key in keys[:2])
    v = jax.random.normal(keys[2], (2, T_, N, 2 * H))
    log_decay = jnp.broadcast_to(retnet_log_decay(N), (2, T_, N))
    s0 = jax.random.normal(keys[3], (2, N, H, 2 * H))
    o_rec, s_rec = retention_recurrent(q, k, v, log_decay, s0)
    for o, s in (retention_parallel(q, k, v, log_decay, s0), retention_chunkwise(q, k, v, log_decay, s0, chunk)):
        np.testing.assert_allclose(o, o_rec, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(s, s_rec, atol=1e-4, rtol=1e-5)
    # the recurrence by hand at token 0: S_0' = gamma S_0 + k_0^T v_0
    gamma = np.exp(np.asarray(retnet_log_decay(N)))
    s1 = gamma[None, :, None, None] * np.asarray(s0) + np.einsum(
        "bnk,bnv->bnkv", np.asarray(k[:, 0]), np.asarray(v[:, 0])
    )
    np.testing.assert_allclose(o_rec[:, 0], np.einsum("bnk,bnkv->bnv", np.asarray(q[:, 0]), s1), atol=1e-4)


@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_forms_give_the_same_model(make_model, form):
    cfg, model = make_model("retnet", "model.n_layers=2", f"model.retnet.form={form}", "model.retnet.chunk=5")
    _, reference = make_model("retnet", "model.n_layers=2", "model.retnet.form=recurrent")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(model(tokens, pos)[0], reference(tokens, pos)[0], atol=2e-5, rtol=1e-5)


def test_cached_decode_equals_full_forward_and_is_causal(make_model):
    cfg, model = make_model("retnet", "model.n_layers=2", "model.retnet.chunk=4")
    assert_cached_decode_equals_full_forward(cfg, model)
    assert_gradient_causal(cfg, model)
    assert_ragged_prefill_continues_each_row(cfg, model)


def test_state_is_constant_and_its_bytes_are_analytic():
    cfg = load_config("retnet").model
    caches = init_caches(cfg, 2, 64)
    assert all(isinstance(c, RetentionState) and c.s.shape == (2, 8, 16, 32) for c in caches)
    assert caches_nbytes(caches) == 2 * memory.state_bytes_per_sequence(cfg) == 2 * 4 * 8 * 16 * 32 * 4
    assert memory.kv_bytes_per_token(cfg) == 0
    assert caches_nbytes(init_caches(cfg, 2, 4096)) == caches_nbytes(caches)
    with pytest.raises(ConfigError, match="model.retnet.form"):
        load_config("retnet", ["model.retnet.form=blocked"])

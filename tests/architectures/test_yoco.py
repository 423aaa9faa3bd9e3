"""YOCO (Sun et al. 2024): gRet forms agree, cached == full, early-exit prefill == full prefill, one
global cache, exact bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import DecodingConfig, Generator, memory
from kvjax.architectures.retention import retention_chunkwise, retention_parallel, retention_recurrent
from kvjax.cache import KVCache, RetentionState, RingKVCache, caches_nbytes
from kvjax.config import ConfigError, load_config
from kvjax.plan import init_caches
from tests.architectures.oracles import B, T, assert_cached_decode_equals_full_forward, stepper, tokens_and_positions

SMALL_WINDOW = "model.yoco.window=8"  # the ring wraps within T = 24 tokens


def random_retention_inputs(T, seed=0, N=3, H=4):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, (2, T, N, H)) for key in keys[:3])
    log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[3], (2, T, N)) * 3) / 16
    s0 = jax.random.normal(keys[4], (2, N, H, H))
    return q, k, v, log_decay, s0


@pytest.mark.parametrize("T_, chunk", [(17, 5), (16, 4), (3, 8)])
def test_gret_parallel_chunkwise_recurrent_agree(T_, chunk):
    inputs = random_retention_inputs(T_)
    o_rec, s_rec = retention_recurrent(*inputs)
    for o, s in (retention_parallel(*inputs), retention_chunkwise(*inputs, chunk)):
        np.testing.assert_allclose(o, o_rec, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(s, s_rec, atol=1e-5, rtol=1e-5)
    # by hand, token 1: S_1 = g_1 (g_0 S_0 + k_0^T v_0) + k_1^T v_1, o_1 = q_1 S_1
    q, k, v, g, s0 = (np.asarray(a, np.float64) for a in inputs)
    d = np.exp(g)
    s1 = d[:, 1, :, None, None] * (d[:, 0, :, None, None] * s0 + np.einsum("bnk,bnv->bnkv", k[:, 0], v[:, 0]))
    s1 += np.einsum("bnk,bnv->bnkv", k[:, 1], v[:, 1])
    np.testing.assert_allclose(o_rec[:, 1], np.einsum("bnk,bnkv->bnv", q[:, 1], s1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
def test_gret_forms_give_the_same_model(make_model, form):
    cfg, model = make_model("yoco-gret", f"model.yoco.gret_form={form}", "model.yoco.chunk=5")
    _, reference = make_model("yoco-gret", "model.yoco.gret_form=recurrent")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(model(tokens, pos)[0], reference(tokens, pos)[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant, overrides", [("yoco-swa", [SMALL_WINDOW]), ("yoco-gret", ["model.yoco.chunk=4"])])
def test_cached_decode_equals_full_forward(make_model, variant, overrides):
    assert_cached_decode_equals_full_forward(*make_model(variant, *overrides))


def test_window_at_least_the_length_is_causal_attention(make_model):
    cfg, wide = make_model("yoco-swa", f"model.yoco.window={T}")
    _, wider = make_model("yoco-swa", "model.yoco.window=1000")
    _, narrow = make_model("yoco-swa", "model.yoco.window=4")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_array_equal(wide(tokens, pos)[0], wider(tokens, pos)[0])
    assert not np.allclose(narrow(tokens, pos)[0], wide(tokens, pos)[0])


@pytest.mark.parametrize("variant", ["yoco-swa", "yoco-gret", "gqa", "cla2"])
def test_early_exit_prefill_equals_full_prefill(make_model, variant):
    """Same next-token logits, same caches, same greedy continuation; rows of different lengths."""
    cfg, model = make_model(variant, SMALL_WINDOW) if variant == "yoco-swa" else make_model(variant)
    half = cfg.n_layers // 2
    assert model.tail_start == {"yoco-swa": half, "yoco-gret": half, "gqa": cfg.n_layers - 1, "cla2": 2}[variant]
    tokens, pos = tokens_and_positions(cfg.vocab_size, seed=3)
    lengths = jnp.array([T, 15])
    ragged = jnp.where(pos < lengths[:, None], pos, -1)
    last, early = model.prefill_last(tokens, ragged, init_caches(cfg, B, 40), lengths - 1)
    hidden, full = model.hidden(tokens, ragged, init_caches(cfg, B, 40))
    np.testing.assert_allclose(
        model.logits(last), model.logits(hidden[jnp.arange(B), lengths - 1]), atol=2e-5, rtol=1e-5
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5), early, full)

    gen = Generator(model, capacity=40)
    prompts = [np.asarray(tokens[0]).tolist(), np.asarray(tokens[1, :15]).tolist()]
    out = gen(prompts, DecodingConfig(max_new_tokens=8))
    forward = stepper(model, jit=True)
    reference = []
    for prompt in prompts:  # greedy by full forwards over the growing sequence (right-padded to 32)
        seq = list(prompt)
        for _ in range(8):
            ids = jnp.asarray([seq + [0] * (32 - len(seq))])
            positions = jnp.where(jnp.arange(32) < len(seq), jnp.arange(32), -1)[None]
            logits, _ = forward(ids, positions, None)
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        reference.append(seq[len(prompt) :])
    np.testing.assert_array_equal(out.tokens, np.asarray(reference))


@pytest.mark.parametrize("n_layers", [2, 4, 8])
@pytest.mark.parametrize("variant", ["yoco-swa", "yoco-gret"])
def test_exactly_one_global_cache_whatever_the_depth(variant, n_layers):
    cfg = load_config(variant, [f"model.n_layers={n_layers}"]).model
    caches = init_caches(cfg, 2, 100)
    growing = [c for c in caches if isinstance(c, KVCache)]
    assert len(growing) == 1
    own = RingKVCache if variant == "yoco-swa" else RetentionState
    assert sum(isinstance(c, own) for c in caches) == n_layers // 2 == len(caches) - 1
    assert memory.kv_bytes_per_token(cfg) == 2 * cfg.attention.n_kv_heads * cfg.attention.head_dim * 4


@pytest.mark.parametrize("variant", ["yoco-swa", "yoco-gret"])
@pytest.mark.parametrize("capacity", [1, 63, 64, 65, 500])
def test_measured_bytes_equal_analytic(variant, capacity):
    cfg = load_config(variant).model
    assert caches_nbytes(init_caches(cfg, 3, capacity)) == memory.cache_bytes(cfg, capacity, batch=3)


def test_gret_state_does_not_grow(make_model):
    cfg, model = make_model("yoco-gret")
    short = init_caches(cfg, 1, 16)[0]
    long = init_caches(cfg, 1, 4096)[0]
    assert short.nbytes() == long.nbytes() == cfg.attention.n_heads * cfg.attention.head_dim**2 * 4
    assert memory.state_bytes_per_sequence(cfg) == 2 * short.nbytes() + 4  # 2 states + the global length


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_layers=3"], "model.n_layers=3 must be even and >= 2 for YOCO"),
        (["model.attention.window=8"], "model.attention.window=8 must be None with model.yoco"),
        (["model.kv_sharing.kind=cla", "model.kv_sharing.factor=2"], "model.kv_sharing.kind='cla' must be 'none'"),
        (["model.layer_pattern=[mla]"], "model.layer_pattern=('mla',) must be ('attention',) with model.yoco"),
        (["model.yoco.self_mixer=mamba"], "model.yoco.self_mixer='mamba' must be one of ('swa', 'gret')"),
        (["model.yoco.gret_form=fast"], "model.yoco.gret_form='fast' must be one of"),
        (["model.yoco.window=0"], "model.yoco.window=0 must be > 0"),
    ],
)
def test_invalid_settings_raise(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("yoco-swa", overrides)
    assert message in str(info.value)

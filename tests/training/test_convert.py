"""Converting a trained model to another KV architecture: exact at no reduction, mean-pooling as the GQA
paper defines it, exact bytes, the cached-decode oracle, and clear refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.cache import caches_nbytes
from kvjax.config import ConfigError
from kvjax.memory import cache_bytes
from kvjax.memory import kv_bytes_per_token as memory_per_token
from kvjax.plan import init_caches
from kvjax.training.convert import convert, parse_conversion, pool_heads
from tests.architectures.oracles import assert_cached_decode_equals_full_forward, tokens_and_positions
from tests.conftest import GEMMA_LIKE


def _with_random_norms(model, seed=0):
    """A copy with random pre-norm scales (they start at 1), so that a new K/V norm's start matters."""
    model, rng = nnx.clone(model), np.random.default_rng(seed)
    for block in model.blocks:
        for norm in (block.mixer_norm, block.mlp_norm, block.post_mixer_norm, block.post_mlp_norm):
            if norm is None:  # no sandwich
                continue
            norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32))
    return model


@pytest.fixture(scope="module")
def source(make_model):
    """A 4-layer MHA model (8 heads of 16) with random pre-norm scales."""
    return _with_random_norms(make_model("mha", "model.init_std=0.2")[1])


def _logits(model, length=24):
    tokens, pos = tokens_and_positions(model.config.vocab_size, length=length)
    return np.asarray(jax.jit(lambda t, p: model(t, p)[0])(tokens, pos))


@pytest.mark.parametrize(
    "text",
    [
        "gqa:kv_heads=8",
        "cla:factor=1",
        "cla1:merge=keep",
        "mlkv:layers=4",
        "swa:window=100",
        "gqa:kv_heads=8,pool=first+mlkv:layers=4",
    ],
)
def test_no_reduction_reproduces_the_source(source, text):
    converted = convert(source, parse_conversion(text))
    np.testing.assert_allclose(_logits(converted), _logits(source), atol=1e-5)


def test_yoco_with_a_one_layer_cross_decoder_reproduces_the_source(make_model):
    """YOCO cannot be exact in general (upper layers read K/V made from a lower layer's input). Its
    closest degenerate case is: 2 layers (a one-layer cross-decoder making its own K/V through a K/V
    norm that starts as its pre-norm) and a window that covers the text."""
    two = _with_random_norms(make_model("mha", "model.n_layers=2", "model.init_std=0.2")[1])
    for merge in ("mean", "keep"):
        converted = convert(two, parse_conversion(f"yoco-swa:window=64,merge={merge}"))
        assert converted.config.mixers == ("swa", "attention") and converted.blocks[1].kv_norm is not None
        np.testing.assert_allclose(_logits(converted), _logits(two), atol=1e-5)


def test_mean_pooling_is_the_group_mean_of_contiguous_heads():
    kernel = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 12)  # D=2, 4 heads of 3
    pooled = np.asarray(pool_heads(kernel, 2, 3, "mean"))
    k = np.asarray(kernel)
    np.testing.assert_allclose(pooled[:, :3], (k[:, 0:3] + k[:, 3:6]) / 2)  # heads 0, 1 -> KV head 0
    np.testing.assert_allclose(pooled[:, 3:], (k[:, 6:9] + k[:, 9:12]) / 2)  # heads 2, 3 -> KV head 1
    np.testing.assert_array_equal(pool_heads(kernel, 2, 3, "first"), np.concatenate([k[:, 0:3], k[:, 6:9]], 1))


def test_cla_merges_each_groups_projections_into_its_producer(source):
    converted = convert(source, parse_conversion("mqa+cla2"))
    assert converted.config.kv_source == (0, 0, 2, 2) and converted.config.attention.n_kv_heads == 1
    assert converted.blocks[1].mixer.k is None and converted.blocks[0].kv_norm is not None
    layers = [np.asarray(source.blocks[i].mixer.k.kernel[...]).reshape(128, 8, 16) for i in (2, 3)]
    want = np.mean(layers, axis=0).mean(axis=1)  # layers 2 and 3 averaged, then the 8 heads
    np.testing.assert_allclose(converted.blocks[2].mixer.k.kernel[...], want, atol=1e-6)
    np.testing.assert_array_equal(converted.blocks[2].kv_norm.scale[...], source.blocks[2].mixer_norm.scale[...])
    kept = convert(source, parse_conversion("cla2:merge=keep"))
    np.testing.assert_array_equal(kept.blocks[2].mixer.v.kernel[...], source.blocks[2].mixer.v.kernel[...])


@pytest.mark.parametrize("text", ["mqa+cla2", "yoco-swa:window=8"])
def test_converted_models_decode_exactly_and_hold_the_analytic_bytes(make_model, text):
    source = make_model("mha")[1]  # default init: logits of order 1, as the oracle's tolerance assumes
    converted = convert(source, parse_conversion(text))
    cfg = converted.config
    caches = assert_cached_decode_equals_full_forward(cfg, converted, length=20, prefill=12)
    assert caches_nbytes(caches) == cache_bytes(cfg, 20, batch=2)
    assert caches_nbytes(init_caches(cfg, 1, 1000)) < caches_nbytes(init_caches(source.config, 1, 1000))


@pytest.mark.parametrize(
    "text, message",
    [
        ("gqa:kv_heads=3", "cannot map 8 KV heads to kv_heads=3; a divisor of 8 is needed"),
        ("gqa", "needs kv_heads=N"),
        ("gqa:kv_heads=0", "kv_heads='0' must be an integer >= 1"),
        ("cla:factor=5", "factor=5 must be <= n_layers=4"),
        ("mqa:pool=max", "pool='max' must be one of"),
        ("cla2:merge=sum", "merge='sum' must be one of"),
        ("cla2:window=3", "unknown option"),
        ("moe", "'moe' must be one of"),
        ("cla2+yoco-swa:window=8", "drop cla/mlkv"),
        ("", "is empty"),
    ],
)
def test_bad_conversions_are_refused_before_any_compute(source, text, message):
    with pytest.raises(ConfigError, match=message):
        convert(source, parse_conversion(text))


def test_a_source_that_already_shares_kv_or_has_one_kv_head_is_refused(make_model):
    _, cla = make_model("cla2")
    with pytest.raises(ConfigError, match="already shares K/V across layers"):
        convert(cla, parse_conversion("mlkv:layers=1"))
    _, mqa = make_model("mqa", "model.n_layers=2")
    with pytest.raises(ConfigError, match="one KV head already .MQA, as Gemma 3 270M.: there are no heads to pool"):
        convert(mqa, parse_conversion("mqa+cla2"))
    _, mamba = make_model("mamba", "model.n_layers=2")
    with pytest.raises(ConfigError, match=r"must be an attention model \(its mixers: \['mamba'\]\)"):
        convert(mamba, parse_conversion("cla2"))


def test_a_local_and_global_source_takes_head_pooling_and_a_window(make_model):
    """Gemma's layout (local windows of 8 beside global layers, sandwich and q/k norms): at no reduction
    gqa and swa reproduce it; swa windows the global layers only; mqa pools; the stages that would mix
    or replace the two kinds of layer are refused by name."""
    gemma = _with_random_norms(make_model("gqa", *GEMMA_LIKE, "model.init_std=0.2")[1])
    want = _logits(gemma)
    for text in ("gqa:kv_heads=2", "swa:window=100"):
        np.testing.assert_allclose(_logits(convert(gemma, parse_conversion(text))), want, atol=1e-5)
    windowed = convert(gemma, parse_conversion("mqa+swa:window=16")).config
    assert windowed.attention.window == 16 and windowed.attention_for("local").window == 8
    assert windowed.attention.n_kv_heads == 1 and windowed.mixers == gemma.config.mixers
    for text, stage in [("cla2", "cla"), ("yoco-swa:window=4", "yoco-swa"), ("mla:d_c=8,rope_dims=4", "mla")]:
        with pytest.raises(ConfigError, match=f"{stage} does not apply to a source with local .sliding-window. layers"):
            convert(gemma, parse_conversion(text))


def test_qkv_biases_and_qk_norms_are_kept_and_pooled_like_the_kernels(make_model):
    """Qwen2-style biases and Qwen3-style q/k norms: kept exactly at no reduction; the K/V biases
    mean-pooled with their heads, the one key norm (shared by the heads) kept; MLA refuses the norms."""
    model = nnx.clone(make_model("mha", "model.attention.qkv_bias=true", "model.attention.qk_norm=true")[1])
    rng = np.random.default_rng(2)
    for block in model.blocks:
        for proj in (block.mixer.q, block.mixer.k, block.mixer.v):
            proj.bias.set_value(jnp.asarray(rng.normal(size=proj.bias.shape), jnp.float32))
        for norm in (block.mixer.q_norm, block.mixer.k_norm):
            norm.scale.set_value(jnp.asarray(1 + rng.normal(size=norm.scale.shape), jnp.float32))
    np.testing.assert_allclose(_logits(convert(model, parse_conversion("gqa:kv_heads=8"))), _logits(model), atol=1e-5)
    mqa = convert(model, parse_conversion("mqa"))
    want = np.asarray(model.blocks[1].mixer.v.bias[...]).reshape(8, 16).mean(axis=0)
    np.testing.assert_allclose(mqa.blocks[1].mixer.v.bias[...], want, atol=1e-6)
    np.testing.assert_array_equal(mqa.blocks[1].mixer.q.bias[...], model.blocks[1].mixer.q.bias[...])
    np.testing.assert_array_equal(mqa.blocks[1].mixer.k_norm.scale[...], model.blocks[1].mixer.k_norm.scale[...])
    with pytest.raises(ConfigError, match="q/k norms"):
        convert(model, parse_conversion("mla:d_c=8,rope_dims=4,select=high"))


MLA_SOURCE = ("gqa", "model.init_std=0.2")  # 8 query heads over 2 KV heads of 16 dims


def _partial_rope_probs(model, layer, h, pos, pairs):
    """Attention probabilities `[B,T,N,S]` of the source's layer `layer` for normed inputs h, computed
    from its own weights with RoPE kept only on each KV head's `pairs` (angle 0 on the others):
    MHA2MLA's partial RoPE."""
    from kvjax.ops import visible
    from kvjax.rope import frequencies, rotate

    att = model.config.attention
    B, T, N, G, d = *h.shape[:2], att.n_heads, att.n_kv_heads, att.head_dim
    q = model.blocks[layer].mixer.q(h).reshape(B, T, N, d)
    k = model.blocks[layer].mixer.k(h).reshape(B, T, G, d)
    kept = np.zeros((G, d // 2), bool)
    for j, ks in enumerate(pairs):
        kept[j, list(ks)] = True
    inv = np.where(kept, np.asarray(frequencies(np.arange(d // 2), d, att.rope_theta)), 0.0).astype(np.float32)
    q = rotate(q, pos[:, :, None], 0.0, jnp.asarray(np.repeat(inv, N // G, axis=0))[None, None])
    k = rotate(k, pos[:, :, None], 0.0, jnp.asarray(inv)[None, None])
    logits = jnp.einsum("btnd,bsnd->btns", q, jnp.repeat(k, N // G, axis=2)) / np.sqrt(d)
    mask = visible(pos, pos)[:, :, None, :]
    return jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)


@pytest.mark.parametrize("select", ["high", "norm"])
def test_mla_at_full_rank_with_every_rope_pair_is_the_source(make_model, select):
    """MHA2MLA's first oracle: every pair kept (rope_dims = head_dim) and full rank (d_c = 2 KV heads x
    16 value dims): the joint SVD reconstructs the values exactly."""
    _, source = make_model(*MLA_SOURCE)
    tokens, _ = tokens_and_positions(source.config.vocab_size)
    converted = convert(source, parse_conversion(f"mla:d_c=32,rope_dims=16,select={select}"), np.asarray(tokens))
    assert converted.config.mixers == ("mla",) * 4 and converted.config.mla.rope_heads == 2
    np.testing.assert_allclose(_logits(converted), _logits(source), atol=1e-4)


def test_mla_partial_rope_at_full_rank_equals_the_partial_rope_model(make_model):
    """MHA2MLA's second oracle: with 2 of 8 pairs kept per KV head (by the 2-norm rule) and full rank
    (d_c = 2 KV heads x (12 key + 16 value dims)), each converted layer's attention is the source
    layer's with RoPE removed from the other pairs, on the same inputs."""
    _, source = make_model(*MLA_SOURCE)
    tokens, pos = tokens_and_positions(source.config.vocab_size)
    converted = convert(source, parse_conversion("mla:d_c=56,rope_dims=4"), np.asarray(tokens))  # 2 x (12 + 16)
    pairs = converted.config.mla.rope_pairs
    for layer in (0, 1):
        x = converted.embed(tokens)
        for block in converted.blocks[:layer]:
            x = block(x, pos)[0]
        block = converted.blocks[layer]
        h = block.mixer_norm(x)
        _, _, view = block.mixer(h, pos)  # the latent view of the layer's own tokens
        got = block.mixer.probs(h, pos, view)[:, 0]  # [B,T,N,S]
        np.testing.assert_allclose(got, _partial_rope_probs(source, layer, h, pos, pairs[layer]), atol=2e-5)


def test_the_two_norm_rule_ranks_pairs_by_query_times_key_norms(make_model):
    """Layer 0's choice recomputed by hand: per KV head, the top pairs of (sum over its query heads of
    the mean pair norm of q) x (mean pair norm of k)."""
    from kvjax.training.convert import rope_pairs

    _, source = make_model(*MLA_SOURCE)
    tokens, _ = tokens_and_positions(source.config.vocab_size)
    h = np.asarray(source.blocks[0].mixer_norm(source.embed(tokens)))
    q = (h @ np.asarray(source.blocks[0].mixer.q.kernel[...])).reshape(2, 24, 8, 2, 8)
    k = (h @ np.asarray(source.blocks[0].mixer.k.kernel[...])).reshape(2, 24, 2, 2, 8)
    qn = np.sqrt((q**2).sum(3)).mean((0, 1)).reshape(2, 4, 8).sum(1)
    kn = np.sqrt((k**2).sum(3)).mean((0, 1))
    want = tuple(tuple(sorted(np.argsort(-(qn * kn)[j])[:3].tolist())) for j in range(2))
    assert rope_pairs(source, 3, "norm", np.asarray(tokens))[0] == want


def test_a_reduced_mla_decodes_exactly_with_the_analytic_bytes(make_model):
    _, source = make_model("gqa")
    tokens, _ = tokens_and_positions(source.config.vocab_size)
    converted = convert(source, parse_conversion("mla:d_c=12,rope_dims=4"), np.asarray(tokens))
    cfg = converted.config
    caches = assert_cached_decode_equals_full_forward(cfg, converted, length=20, prefill=12)
    assert caches_nbytes(caches) == cache_bytes(cfg, 20, batch=2)
    assert memory_per_token(cfg) == 4 * (12 + 2 * 4) * 4 < memory_per_token(source.config)


@pytest.mark.parametrize(
    "text, message",
    [
        ("mla:d_c=40,rope_dims=16", "d_c=40 must be <= 32"),
        ("mla:d_c=8,rope_dims=3", "rope_dims=3 must be even"),
        ("mla:d_c=8", "needs rope_dims=N"),
        ("mla:d_c=8,rope_dims=4,select=low", "select='low' must be one of"),
        ("mqa+mla:d_c=8,rope_dims=4", "drop the other stages"),
    ],
)
def test_bad_mla_conversions_are_refused(make_model, text, message):
    with pytest.raises(ConfigError, match=message):
        convert(make_model("gqa")[1], parse_conversion(text))


def test_the_norm_rule_needs_calibration(make_model):
    with pytest.raises(ConfigError, match="calibration"):
        convert(make_model("gqa")[1], parse_conversion("mla:d_c=8,rope_dims=4"))

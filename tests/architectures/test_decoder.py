"""Correctness oracles of the decoder (DESIGN.md): cached == full, degenerate == baseline, causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.ops import decode_block
from kvjax.plan import init_caches
from tests.architectures.oracles import (
    B,
    T,
    assert_cached_decode_equals_full_forward,
    assert_gradient_causal,
    stepper,
    tokens_and_positions,
)

TWO_LAYERS = "model.n_layers=2"
# The shipped SWA window (64) exceeds these tiny sequences; 8 makes the ring wrap during the test. MQA
# carries Qwen3's q/k norms (they normalize the keys before they are cached), mqa-half Llama 3's scaled
# RoPE frequencies, MHA Gemma 2's soft-capped attention logits (a cap low enough to act).
SOFTCAP = "model.attention.softcap=0.5"
VARIANTS = {
    "mha": [SOFTCAP],
    "gqa": [],
    "mqa": ["model.attention.qk_norm=true"],
    "mqa-half": ["model.attention.rope_scaling={factor: 8.0, original_max_positions: 16}"],
    "swa": ["model.attention.window=8"],
}


# Eager (op by op) once for full attention and once for the ring: the head counts of the other variants
# change no code path, and each eager run compiles every op anew. GQA jitted is the `attention` case of
# tests/architectures/test_kinds.py.
CASES = [(v, True) for v in VARIANTS if v != "gqa"] + [("gqa", False), ("swa", False)]


@pytest.mark.parametrize("variant, jit", CASES, ids=[f"{v}-{'jit' if j else 'eager'}" for v, j in CASES])
def test_cached_decode_equals_full_forward(make_model, variant, jit):
    cfg, model = make_model(variant, TWO_LAYERS, *VARIANTS[variant])
    # a prefill of 10, longer than the SWA window of 8, exercises the ring's chunk path
    assert_cached_decode_equals_full_forward(cfg, model, prefill=10, jit=jit)


def test_cached_decode_over_key_blocks_equals_full_forward(make_model):
    """40 tokens decoded into 64 slots: every step takes kvjax.ops' blocked path (two blocks of 32) with
    keys in both blocks and empty slots after them; soft-capped logits, as the blocked path caps them too."""
    cfg, model = make_model("gqa", TWO_LAYERS, SOFTCAP)
    assert decode_block(64) == 32
    assert_cached_decode_equals_full_forward(cfg, model, prefill=30, length=40, capacity=64)


@pytest.mark.parametrize("variant", ["gqa", "swa"])
def test_chunked_prefill_and_ragged_rows_equal_full_forward(make_model, variant):
    """Rows of different lengths (right-padded, position -1) fed in chunks of 5 match each row alone."""
    cfg, model = make_model(variant, TWO_LAYERS, *VARIANTS[variant])
    tokens, pos = tokens_and_positions(cfg.vocab_size, seed=1)
    full, _ = model(tokens, pos)
    lengths = np.array([T, 13])
    ragged = jnp.where(pos < lengths[:, None], pos, -1)
    step = stepper(model, jit=True)
    caches = init_caches(cfg, B, T)
    for start in range(0, T, 5):
        logits, caches = step(tokens[:, start : start + 5], ragged[:, start : start + 5], caches)
        for row in range(B):
            valid = slice(start, min(start + 5, lengths[row]))
            got = logits[row, : max(valid.stop - start, 0)]
            np.testing.assert_allclose(got, full[row, valid], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(caches[0].length, lengths)


def copy_into(model, state):
    nnx.update(model, state)
    return model


def test_gqa_equals_mha_with_each_kv_head_repeated_per_group(make_model):
    """GQA is MHA whose K/V projections repeat each kv head for its G query heads (Ainslie et al. 2023)."""
    cfg, gqa = make_model("gqa", TWO_LAYERS)
    mha_cfg, mha = make_model("mha", TWO_LAYERS, seed=1)
    att = cfg.attention
    group = att.n_heads // att.n_kv_heads
    for g_block, m_block in zip(gqa.blocks, mha.blocks):
        for name in ("q", "o"):
            getattr(m_block.mixer, name).kernel[...] = getattr(g_block.mixer, name).kernel[...]
        for name in ("k", "v"):
            w = getattr(g_block.mixer, name).kernel[...].reshape(cfg.d_model, att.n_kv_heads, att.head_dim)
            getattr(m_block.mixer, name).kernel[...] = jnp.repeat(w, group, axis=1).reshape(cfg.d_model, -1)
        for name in ("mixer_norm", "mlp_norm", "mlp"):
            nnx.update(getattr(m_block, name), nnx.state(getattr(g_block, name)))
    nnx.update(mha.embed, nnx.state(gqa.embed))
    nnx.update(mha.final_norm, nnx.state(gqa.final_norm))
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_allclose(mha(tokens, pos)[0], gqa(tokens, pos)[0], atol=1e-5, rtol=1e-5)


def test_gqa_with_n_kv_heads_equal_n_heads_is_mha_exactly(make_model):
    cfg, mha = make_model("mha", TWO_LAYERS)
    _, gqa = make_model("gqa", TWO_LAYERS, "model.attention.n_kv_heads=8")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_array_equal(mha(tokens, pos)[0], gqa(tokens, pos)[0])


@pytest.mark.parametrize("window", [T, 64])
def test_sliding_window_at_least_the_length_is_causal_attention(make_model, window):
    cfg, swa = make_model("swa", TWO_LAYERS, f"model.attention.window={window}")
    _, causal = make_model("swa", TWO_LAYERS, "model.attention.window=null")
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_array_equal(swa(tokens, pos)[0], causal(tokens, pos)[0])
    _, short = make_model("swa", TWO_LAYERS, "model.attention.window=4")
    assert not np.allclose(short(tokens, pos)[0], causal(tokens, pos)[0])  # the window does bite


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradient_causality(make_model, variant):
    cfg, model = make_model(variant, TWO_LAYERS, *VARIANTS[variant])
    assert_gradient_causal(cfg, model)


def test_untied_head_and_bfloat16(make_model):
    cfg, model = make_model("gqa", TWO_LAYERS, "model.tie_embeddings=false", "model.dtype=bfloat16")
    assert model.lm_head is not None and model.embed.embedding.dtype == jnp.bfloat16
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    logits, caches = model(tokens, pos, init_caches(cfg, B, T))
    assert logits.dtype == jnp.float32 and caches[0].k.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(logits)).all()


def test_wrong_number_of_caches_is_an_error(make_model):
    cfg, model = make_model("gqa", TWO_LAYERS)
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    with pytest.raises(ValueError, match="got 1 caches; the plan has 2 producers"):
        model(tokens, pos, init_caches(cfg, B, T)[:1])


def test_parameter_count(make_model):
    cfg, model = make_model("gqa")
    att = cfg.attention
    per_layer = (
        cfg.d_model * att.head_dim * (2 * att.n_heads + 2 * att.n_kv_heads)  # q, o, k, v
        + 3 * cfg.d_model * cfg.ffn_dim  # SwiGLU
        + 2 * cfg.d_model  # two norms
    )
    expected = cfg.vocab_size * cfg.d_model + cfg.n_layers * per_layer + cfg.d_model
    assert sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param))) == expected
    assert isinstance(model, Decoder)

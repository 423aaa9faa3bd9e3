"""SmolLM2-135M from its GGUF file against Hugging Face transformers reading the same file.

transformers dequantizes the GGUF weights and converts its tokenizer with its own code, so it is an
independent reference for our dequantization, Q/K un-permutation, RoPE, tokenizer and export.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from kvjax import DecodingConfig, generate  # noqa: E402
from kvjax.training.data import load_corpus  # noqa: E402
from kvjax.training.gguf_import import GGUFError, load_gguf_model, load_gguf_tokenizer  # noqa: E402
from kvjax.training.hf_export import export_hf  # noqa: E402
from tests.training.gguf_reference import transformers_from_gguf  # noqa: E402

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world!",
    "In the beginning God created the heaven and the earth.",
    "def f(x):\n    return x**2  # 12345 squared\n",
    "  two leading spaces, ünïcödé and emoji 😀\ttabs\n\nnewlines",
    "<|im_start|>user\nWhat is 3.14159 * 1,000,000?<|im_end|>",
]


@pytest.fixture(scope="module")
def ours():
    config, model = load_gguf_model("smollm2")
    return config, model, load_gguf_tokenizer("smollm2")


@pytest.fixture(scope="module")
def reference(ours):  # after ours: transformers reuses the file's parse
    return transformers_from_gguf("smollm2")


@pytest.fixture(scope="module")
def text_ids(ours):
    return ours[2].encode(load_corpus("kjv")[18].text)[:256]  # the Psalms


@pytest.fixture(scope="module")
def full(ours, text_ids):
    """Our logits `[256,V]` over text_ids, computed once (causal: a prefix's logits are its rows)."""
    return np.asarray(ours[1](jnp.asarray([text_ids]), jnp.arange(256)[None])[0][0])


def test_config_comes_from_the_metadata(ours):
    cfg = ours[0].model
    att = cfg.attention
    assert (cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.vocab_size) == (30, 576, 1536, 49152)
    assert (att.n_heads, att.n_kv_heads, att.head_dim, att.rope_theta) == (9, 3, 64, 100000.0)
    assert cfg.tie_embeddings


def test_token_ids_match(ours, reference):
    tokenizer = ours[2]
    for text in TEXTS:
        assert tokenizer.encode(text) == reference[1](text, add_special_tokens=False).input_ids, text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("hi")[0] != tokenizer.bos_id  # nothing special is added to raw text


def test_logits_match_over_256_tokens(full, reference, text_ids):
    assert len(text_ids) == 256
    with torch.no_grad():
        expected = reference[0](torch.tensor([text_ids])).logits[0].numpy()
    assert np.abs(full - expected).max() < 1e-3


def test_greedy_continuations_match(ours, reference, text_ids):
    """Our cached decode of SmolLM2 (prefill, then one token a step) continues as transformers does; the
    cached-decode == full-forward oracle itself runs on every architecture in tests/architectures/."""
    prompt = text_ids[:64]
    got = generate(ours[1], [prompt], DecodingConfig(max_new_tokens=24)).tokens[0]
    with torch.no_grad():
        out = reference[0].generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            attention_mask=torch.ones(1, 64, dtype=torch.long),
        )
    np.testing.assert_array_equal(got, out[0, 64:].numpy())


def test_a_conversion_without_reduction_reproduces_smollm2(ours, text_ids, full):
    """Keeping all 3 KV heads (first of each group of one) and a K/V layer for each of the 30 layers is
    SmolLM2 itself."""
    from kvjax.training.convert import convert, parse_conversion

    ids, pos = jnp.asarray([text_ids[:32]]), jnp.arange(32)[None]
    same = convert(ours[1], parse_conversion("gqa:kv_heads=3,pool=first+mlkv:layers=30"))
    # fp32 through 30 layers, summed in another order: logits of ~10 move by ~1e-4 (any wrong weight moves them by ~1)
    np.testing.assert_allclose(same(ids, pos)[0][0], full[:32], atol=1e-4, rtol=1e-4)


def test_an_mqa_smollm2_exports_to_a_llama_that_transformers_runs(ours, text_ids, full, tmp_path):
    from kvjax.training.convert import convert, parse_conversion
    from kvjax.training.hf_import import load_hf_model

    mqa = convert(ours[1], parse_conversion("mqa"))
    export_hf(mqa, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == 1
    ids = text_ids[:64]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    logits, _ = mqa(jnp.asarray([ids]), jnp.arange(64)[None])
    # The untrained conversion amplifies float differences more than SmolLM2 does (logits up to ~12).
    assert np.abs(np.asarray(logits[0]) - expected).max() < 5e-3
    assert np.abs(np.asarray(logits[0]) - full[:64]).max() > 1.0  # 3 heads pooled into 1 is not SmolLM2
    back = load_hf_model(tmp_path)[1]  # and reads back into kvjax by directory
    np.testing.assert_allclose(back(jnp.asarray([ids]), jnp.arange(64)[None])[0], logits, atol=1e-5)


def test_export_round_trip(ours, text_ids, full, tmp_path):
    _, model, tokenizer = ours
    export_hf(model, tmp_path, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([text_ids[:128]])).logits[0].numpy()
    assert np.abs(full[:128] - expected).max() < 1e-3


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(GGUFError, match="is not a file, nor a shipped model name"):
        load_gguf_model(tmp_path / "nope.gguf")


def test_chat_turn_is_the_models_template_as_transformers_renders_it(ours, reference):
    before, after = ours[2].chat_turn()
    message = [{"role": "user", "content": "Where is the key?"}]
    rendered = reference[1].apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    assert before + "Where is the key?" + after == rendered
    assert after.endswith("<|im_start|>assistant\n")

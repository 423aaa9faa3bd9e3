"""GGUF import on small files written here: weights, the Q/K permutation and clear errors."""

import jax
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from flax import nnx  # noqa: E402

from kvjax.architectures import Decoder  # noqa: E402
from kvjax.config import ConfigError, load_config  # noqa: E402
from kvjax.training.families.llama import unpermute_rope_rows  # noqa: E402
from kvjax.training.gguf_import import GGUFError, load_gguf_model  # noqa: E402


def llama_cpp_permute(w, n_heads):
    """What llama.cpp's convert_hf_to_gguf does to Q and K rows: halves -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, arch="llama", rope_freqs=None):
    """A GGUF file of `model` as llama.cpp's converter writes `arch` (Qwen3: Q/K rows not permuted, and
    each layer's q/k norms); `rope_freqs`: the per-pair frequency factors llama.cpp stores for Llama 3."""
    cfg, att = model.config, model.config.attention
    rope = llama_cpp_permute if arch == "llama" else lambda w, heads: w
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(att.n_heads)
    w.add_head_count_kv(att.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(att.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    f32 = lambda v: np.asarray(v[...], np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(model.embed.embedding))
    w.add_tensor("output_norm.weight", f32(model.final_norm.scale))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", f32(b.mixer_norm.scale))
        w.add_tensor(p + "attn_q.weight", rope(f32(b.mixer.q.kernel).T.copy(), att.n_heads))
        w.add_tensor(p + "attn_k.weight", rope(f32(b.mixer.k.kernel).T.copy(), att.n_kv_heads))
        if att.qk_norm:
            w.add_tensor(p + "attn_q_norm.weight", f32(b.mixer.q_norm.scale))
            w.add_tensor(p + "attn_k_norm.weight", f32(b.mixer.k_norm.scale))
        w.add_tensor(p + "attn_v.weight", f32(b.mixer.v.kernel).T.copy())
        w.add_tensor(p + "attn_output.weight", f32(b.mixer.o.kernel).T.copy())
        w.add_tensor(p + "ffn_norm.weight", f32(b.mlp_norm.scale))
        w.add_tensor(p + "ffn_gate.weight", f32(b.mlp.gate.kernel).T.copy())
        w.add_tensor(p + "ffn_up.weight", f32(b.mlp.up.kernel).T.copy())
        w.add_tensor(p + "ffn_down.weight", f32(b.mlp.down.kernel).T.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp():
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_written_from_a_kvjax_model_loads_back_exactly(tmp_path, arch):
    qk_norm = f"model.attention.qk_norm={arch == 'qwen3'}"
    cfg = load_config("gqa", ["model.n_layers=2", "model.attention.rope_theta=500.0", qk_norm]).model
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    if cfg.attention.qk_norm:  # norms start at one: make them matter
        for b in model.blocks:
            for norm in (b.mixer.q_norm, b.mixer.k_norm):
                norm.scale.set_value(norm.scale[...] + np.random.default_rng(0).normal(size=norm.scale.shape))
    write_gguf(tmp_path / "tiny.gguf", model, arch)
    config, loaded = load_gguf_model(tmp_path / "tiny.gguf")
    assert config.model.attention == cfg.attention and config.model.tie_embeddings
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(a, b)


def test_unsupported_architecture_and_scaled_rope_are_clear_errors(tmp_path):
    model = Decoder(load_config("gqa", ["model.n_layers=1"]).model, rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "other.gguf", model, arch="falcon")
    with pytest.raises(GGUFError, match="general.architecture='falcon' is not supported"):
        load_gguf_model(tmp_path / "other.gguf")
    write_gguf(tmp_path / "llama3.gguf", model, rope_freqs=np.ones(model.config.attention.head_dim // 2))
    with pytest.raises(ConfigError, match="rope_freqs.weight .Llama 3 RoPE scaling. is not read"):
        load_gguf_model(tmp_path / "llama3.gguf")

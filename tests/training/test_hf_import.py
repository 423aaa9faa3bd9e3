"""Hugging Face checkpoint directories (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3) load as kvjax models that
compute what transformers computes, kvjax's own export reads back exactly, and what kvjax cannot express is refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.config import ConfigError
from kvjax.training.hf_export import export_hf
from kvjax.training.hf_import import HFImportError, load_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=1000.0,
    rms_norm_eps=1e-5,
)


def _save(family: str, directory, **extra):
    """A randomly initialised tiny model written by transformers' save_pretrained (biases made non-zero)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}TextConfig" if family == "Gemma3" else f"{family}Config")(**TINY, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return model


def _ids(length=12):
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, length))


@pytest.mark.parametrize(
    "family, extra",
    [
        ("Llama", {}),
        ("Llama", {"tie_word_embeddings": True}),
        ("Mistral", {"sliding_window": 5}),  # 12 tokens: the window matters
        ("Qwen2", {}),  # query/key/value biases
        (  # Llama 3.1's RoPE frequency scaling; a 16-token original context puts a pair in each band
            "Llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        ("Qwen3", {"head_dim": 8}),  # q/k norms
        ("Phi3", {"sliding_window": 5, "pad_token_id": 0}),  # fused qkv and gate/up projections
        (  # Gemma 3 without q/k norms, soft-capped logits (caps below the tiny logits: they act)
            "Gemma2",
            {"head_dim": 8, "sliding_window": 5, "attn_logit_softcapping": 0.002, "final_logit_softcapping": 0.1},
        ),
        (  # local/global layers with their RoPE bases, offset sandwich norms, GeGLU, scaled embeddings
            "Gemma3",
            {
                "head_dim": 8,
                "sliding_window": 5,
                "query_pre_attn_scalar": 12,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                },
            },
        ),
    ],
)
def test_logits_match_transformers(tmp_path, family, extra):
    reference = _save(family, tmp_path, **extra)
    config, model = load_hf_model(tmp_path)
    ids = _ids()
    ours, _ = model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape))
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4)
    att = config.model.attention
    if family.startswith("Gemma"):
        assert config.model.mixers == ("local", "attention") and config.model.local.window == 5
    else:
        assert att.window == extra.get("sliding_window")
    assert att.qkv_bias == (family == "Qwen2") and att.qk_norm == (family in ("Qwen3", "Gemma3"))
    assert att.softcap == extra.get("attn_logit_softcapping")
    assert (att.rope_scaling is not None) == ("rope_scaling" in extra)


def test_a_bf16_checkpoint_loads_tensor_by_tensor_in_the_dtype_asked(tmp_path):
    """A bfloat16 checkpoint (Phi-3's fused projections: row slices of one tensor) loads straight into a
    bfloat16 model, each weight the file's own bits, and into float32 exactly; nothing is read as a whole
    fp32 dictionary first."""
    reference = _save("Phi3", tmp_path, torch_dtype=torch.bfloat16, sliding_window=5, pad_token_id=0)
    reference.to(torch.bfloat16).save_pretrained(tmp_path)
    _, half = load_hf_model(tmp_path, dtype="bfloat16")
    _, full = load_hf_model(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(half, nnx.Param)), jax.tree.leaves(nnx.state(full, nnx.Param))):
        assert a.dtype == jnp.bfloat16 and b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))  # bf16 values, exact in fp32
    ids = jnp.asarray(_ids())
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    np.testing.assert_allclose(half(ids, positions)[0], full(ids, positions)[0], atol=0.05)  # bf16 activations


@pytest.mark.parametrize(
    "family, extra",
    [
        ("Gemma3", {"query_pre_attn_scalar": 12, "sliding_window_pattern": 2}),
        ("Gemma2", {"attn_logit_softcapping": 0.002, "final_logit_softcapping": 0.1}),
    ],
)
def test_a_gemma_checkpoint_exports_back_to_what_transformers_reads(tmp_path, family, extra):
    """Gemma's layer types, RoPE bases, offset norms, query scale and soft-caps survive kvjax's export."""
    reference = _save(family, tmp_path / "in", head_dim=8, sliding_window=5, **extra)
    _, model = load_hf_model(tmp_path / "in")
    export_hf(model, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(reference)
    ids = torch.tensor(_ids())
    with torch.no_grad():
        np.testing.assert_allclose(again(ids).logits.numpy(), reference(ids).logits.numpy(), atol=1e-5)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layer_types"][:2] == [
        "sliding_attention",
        "full_attention",
    ]


def test_a_phi3_checkpoint_exports_back_as_phi3_or_by_default_as_mistral(tmp_path):
    """Phi-3's fused projections are split on import and joined again on export; the same weights
    written in Llama's layout (Mistral's, for the window) run the same in transformers."""
    reference = _save("Phi3", tmp_path / "in", sliding_window=5, pad_token_id=0)
    _, model = load_hf_model(tmp_path / "in")
    ids = torch.tensor(_ids())
    with torch.no_grad():
        want = reference(ids).logits.numpy()
    for architecture, out in (("Phi3ForCausalLM", "phi3"), (None, "mistral")):
        export_hf(model, tmp_path / out, architecture=architecture)
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        assert type(again).__name__.lower().startswith(out)
        with torch.no_grad():
            np.testing.assert_allclose(again(ids).logits.numpy(), want, atol=1e-5)
    with pytest.raises(ConfigError, match="'Qwen3ForCausalLM' does not express .*ones that do: Llama.*Phi3"):
        export_hf(model, tmp_path / "x", architecture="Qwen3ForCausalLM")
    with pytest.raises(ConfigError, match="architecture='LlamaForCausalLM': kvjax writes this model as Mistral"):
        export_hf(model, tmp_path / "x", architecture="LlamaForCausalLM")


def test_a_model_with_qk_norms_exports_as_qwen3_that_transformers_runs(make_model, tmp_path):
    """Export picks the family that expresses the model: q/k norms make it a Qwen3 directory, which
    transformers runs to kvjax's logits and kvjax reads back exactly."""
    from flax import nnx

    cfg, model = make_model("gqa", "model.n_layers=2", "model.attention.qk_norm=true")
    model, rng = nnx.clone(model), np.random.default_rng(2)
    for block in model.blocks:  # norms start at one: make them matter
        for norm in (block.mixer.q_norm, block.mixer.k_norm):
            norm.scale.set_value(jnp.asarray(1 + rng.normal(size=norm.scale.shape), jnp.float32))
    export_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    ids, pos = _ids() % cfg.vocab_size, jnp.broadcast_to(jnp.arange(12), (2, 12))
    ours = model(jnp.asarray(ids), pos)[0]
    _, back = load_hf_model(tmp_path)
    np.testing.assert_allclose(back(jnp.asarray(ids), pos)[0], ours, atol=1e-6)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        np.testing.assert_allclose(reference(torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)


def test_kvjax_export_reads_back_exactly(make_model, tmp_path):
    from flax import nnx

    cfg, model = make_model("gqa", "model.n_layers=2", "model.attention.qkv_bias=true")
    model, rng = nnx.clone(model), np.random.default_rng(1)
    for block in model.blocks:  # biases start at zero: make them matter
        for proj in (block.mixer.q, block.mixer.k, block.mixer.v):
            proj.bias.set_value(jnp.asarray(rng.normal(size=proj.bias.shape), jnp.float32))
    export_hf(model, tmp_path)
    _, back = load_hf_model(tmp_path)
    ids = jnp.asarray(_ids())
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    np.testing.assert_allclose(back(ids % cfg.vocab_size, pos)[0], model(ids % cfg.vocab_size, pos)[0], atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures='GPT2LMHeadModel' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type=.linear. is not"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling=.* is not expressible"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not expressible"),
        (
            {"use_sliding_window": True, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            "max_window_layers",
        ),
        (
            {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "rope_scaling.type='longrope' is not expressible",
        ),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ],
)
def test_what_kvjax_cannot_express_is_refused_by_name(tmp_path, change, message):
    _save("Llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(HFImportError, match=message):
        load_hf_model(tmp_path)
    with pytest.raises(HFImportError, match="not a Hugging Face checkpoint"):
        load_hf_model(tmp_path / "missing")


def test_a_checkpoint_directory_is_a_model_for_eval_generate_and_uptrain(make_model, tmp_path):
    """With its tokenizer.json beside it, an exported kvjax model loads by directory like a run or a
    GGUF file, and uptrains with its own tokenizer (`data.tokenizer=hf:<dir>`); `kvjax memory` reads
    either directory's config without its weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvjax import memory
    from kvjax.commands.memory import memory_table
    from kvjax.training.loading import load_model, model_config
    from kvjax.training.uptrain import uptrain
    from tests.training.conftest import SMALL_CORPUS

    cfg, model = make_model("gqa", "model.n_layers=2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=262, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["def f(x):\n    return {'a': [1, 2]}\n"] * 20, trainer)
    export_hf(model, tmp_path / "hf", bos_id=0, eos_id=1)
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    loaded = load_model(str(tmp_path / "hf"))
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("return [1]")) == "return [1]"
    assert (loaded.bos, loaded.context, loaded.tokenizer.bos_id) == (False, 8192, 0)
    record = uptrain(
        str(tmp_path / "hf"),
        "mqa",
        tmp_path / "up",
        [
            f"data.corpus={SMALL_CORPUS}",
            "data.seq_len=32",
            "data.val_fraction=0.3",
            "data.eval_windows=4",
            "train.steps=2",
            "train.warmup_steps=0",
            "train.batch_size=2",
        ],
        progress=False,
        log=lambda _: None,
    )
    assert record["after"]["step"] == 2
    assert load_model(str(tmp_path / "up")).config.data.tokenizer == f"hf:{tmp_path / 'hf'}"
    hf, up = (model_config(str(tmp_path / name)).model for name in ("hf", "up"))
    assert memory.cache_bytes(hf, 64, 1) == memory.cache_bytes(cfg, 64, 1)
    assert up.attention.n_kv_heads == 1 and hf.attention.n_kv_heads == cfg.attention.n_kv_heads
    table = memory_table([str(tmp_path / "hf"), str(tmp_path / "up")], ["model.dtype=bfloat16"], [64], 1)
    assert "| hf " in table and "bfloat16" in table

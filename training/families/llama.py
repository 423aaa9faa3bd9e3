"""The Llama family (Llama, Mistral, Qwen2 and GGUF `llama` files such as SmolLM2): which kvjax parameter
each stored tensor is, named as Hugging Face checkpoints and as llama.cpp's GGUF files name it, and the
config translation both ways (config.json and GGUF metadata in, `LlamaForCausalLM`'s config.json out).

Hugging Face and GGUF store projections as [out, in], kvjax as [in, out] (`transpose`). llama.cpp's
converter also permutes the rows of Q and K so that RoPE rotates adjacent channel pairs; kvjax (like
Hugging Face) rotates channel i with i + head_dim/2, so those rows are un-permuted on import (`rope`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kvjax.config import AttentionConfig, ConfigError, ModelConfig, RopeScaling
from kvjax.training.families import HFImportError

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = ("llama",)
WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM")  # the architectures here with one sliding window


@dataclasses.dataclass(frozen=True)
class Weight:
    """One stored tensor: its kvjax parameter path (`blocks.3.mixer.q.kernel`), its Hugging Face and GGUF
    names (None: not stored there), whether it is stored transposed, the rows [start, stop) of the
    Hugging Face tensor it is when that tensor fuses several (Phi-3's qkv_proj; None: all of it), and
    (GGUF) the heads whose RoPE rows llama.cpp permuted and what llama.cpp added to the values (Gemma's
    norms: 1)."""

    ours: str
    hf: str | None
    gguf: str | None
    transpose: bool = False
    rope_heads: int | None = None
    gguf_shift: float = 0.0
    hf_rows: tuple[int, int] | None = None


def weights(cfg: ModelConfig) -> list[Weight]:
    """Every tensor of a Llama-family model of config `cfg`, in a fixed order."""
    att = cfg.attention
    out = [
        Weight("embed.embedding", "model.embed_tokens.weight", "token_embd.weight"),
        Weight("final_norm.scale", "model.norm.weight", "output_norm.weight"),
    ]
    if not cfg.tie_embeddings:
        out.append(Weight("lm_head.kernel", "lm_head.weight", "output.weight", transpose=True))
    for i in range(cfg.n_layers):
        hf, gg, ours = f"model.layers.{i}.", f"blk.{i}.", f"blocks.{i}."
        out += [
            Weight(ours + "mixer_norm.scale", hf + "input_layernorm.weight", gg + "attn_norm.weight"),
            Weight(ours + "mlp_norm.scale", hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight"),
        ]
        for name, theirs, gguf, heads in (
            ("q", "q_proj", "attn_q", att.n_heads),
            ("k", "k_proj", "attn_k", att.n_kv_heads),
            ("v", "v_proj", "attn_v", None),
            ("o", "o_proj", "attn_output", None),
        ):
            out.append(
                Weight(
                    f"{ours}mixer.{name}.kernel",
                    f"{hf}self_attn.{theirs}.weight",
                    f"{gg}{gguf}.weight",
                    transpose=True,
                    rope_heads=heads,
                )
            )
            if att.qkv_bias and name != "o":  # Qwen2's Q/K/V biases (GGUF llama files have none)
                out.append(Weight(f"{ours}mixer.{name}.bias", f"{hf}self_attn.{theirs}.bias", None))
        for name, theirs, gguf in (
            ("gate", "gate_proj", "ffn_gate"),
            ("up", "up_proj", "ffn_up"),
            ("down", "down_proj", "ffn_down"),
        ):
            out.append(
                Weight(f"{ours}mlp.{name}.kernel", f"{hf}mlp.{theirs}.weight", f"{gg}{gguf}.weight", transpose=True)
            )
    return out


def parameter(model, path: str):
    """The model's variable at a dotted path (`blocks.3.mixer.q.kernel`)."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> halves) of an [out, in] weight."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _window(hf: dict) -> int | None:
    if hf["model_type"] == "mistral":
        return hf.get("sliding_window")
    if hf["model_type"] == "qwen2" and hf.get("use_sliding_window"):
        raise HFImportError(
            "use_sliding_window=true: Qwen2's per-layer windows (max_window_layers) are not "
            "expressible in kvjax; use a checkpoint with full attention"
        )
    return None


def rope_scaling(hf: dict, where: str) -> RopeScaling | None:
    """Llama 3.1's `rope_type: llama3` scaling from `rope_scaling` (transformers 4) or `rope_parameters`
    (transformers 5); any other RoPE type is refused by name."""
    rope = hf.get("rope_parameters") or {}
    key, scaling = ("rope_scaling", hf["rope_scaling"]) if hf.get("rope_scaling") else ("rope_parameters", rope)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        name = "rope_scaling" if key == "rope_scaling" else "rope_parameters.rope_type"
        value = scaling if key == "rope_scaling" else kind
        raise HFImportError(f"{where}: {name}={value!r} is not expressible in kvjax (supported: llama3)")
    return RopeScaling(
        float(scaling["factor"]),
        float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]),
        int(scaling["original_max_position_embeddings"]),
    )


def from_hf(hf: dict, where: str) -> ModelConfig:
    """The kvjax ModelConfig of a Hugging Face config.json; refuses what kvjax cannot express."""
    rope = hf.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the RoPE type here
    for key, value, ok in (
        ("hidden_act", hf.get("hidden_act"), lambda v: v in (None, "silu")),
        ("mlp_bias", hf.get("mlp_bias"), lambda v: not v),
    ):
        if not ok(value):
            raise HFImportError(f"{where}: {key}={value!r} is not expressible in kvjax")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        name=Path(where).name.lower(),
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype="float32",
        attention=AttentionConfig(
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
            window=_window(hf),
            qkv_bias=hf["model_type"] == "qwen2" or bool(hf.get("attention_bias")),
            rope_scaling=rope_scaling(hf, where),
        ),
    )


def from_gguf(field, tensors: set[str], n_tokens: int | None, path: Path) -> ModelConfig:
    """The kvjax ModelConfig of a GGUF file's metadata (`field(key, default)` reads it), the names of the
    tensors it stores and the size of its tokenizer's vocabulary."""
    arch = field("general.architecture")
    if "rope_freqs.weight" in tensors:  # llama.cpp writes Llama 3.1's scaled frequencies as a tensor
        raise ConfigError(
            f"{path}: tensor rope_freqs.weight (Llama 3 RoPE scaling) is not read from GGUF files yet; "
            "load the Hugging Face checkpoint directory, whose rope_scaling kvjax reads"
        )
    n_heads = int(field(f"{arch}.attention.head_count"))
    d_model = int(field(f"{arch}.embedding_length"))
    vocab = field(f"{arch}.vocab_size", n_tokens)
    return ModelConfig(
        name=str(field("general.name", path.stem)).lower().replace(" ", "-"),
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(field(f"{arch}.block_count")),
        ffn_dim=int(field(f"{arch}.feed_forward_length")),
        norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        dtype="float32",
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=int(field(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=int(field(f"{arch}.attention.key_length", d_model // n_heads)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10_000.0)),
        ),
    )


def plain_block(cfg: ModelConfig) -> bool:
    """Llama's block: RMSNorm (no offset) before the mixer and the MLP only, SwiGLU, unscaled embeddings
    and logits, head_dim^-0.5 attention (whatever its q/k norms)."""
    return (
        cfg.norm_offset == 0
        and not cfg.sandwich_norms
        and cfg.mlp_act == "silu"
        and not cfg.embed_scale
        and cfg.final_softcap is None
        and cfg.attention.query_scale is None
    )


def exports(cfg: ModelConfig) -> bool:
    """Whether this family writes models of `cfg` (a Hugging Face export picks the family that does)."""
    return plain_block(cfg) and not cfg.attention.qk_norm


def check_exportable(cfg: ModelConfig, arch: str | None = None) -> None:
    """Refuse, naming the field, a model that `arch` cannot express: Llama's layout, full causal
    attention in every layer (Mistral and Phi-3: or one sliding window for all), each layer with its own
    K/V. `arch` None: this family's own (Llama, or Mistral for a model with a window)."""
    windowed = arch in (None, *WINDOWED)
    arch = arch or ("MistralForCausalLM" if cfg.attention.window is not None else "LlamaForCausalLM")
    if cfg.attention.window is not None and not windowed:
        raise ConfigError(
            f"model.attention.window={cfg.attention.window}: {arch} has no sliding window; export a "
            "model with full causal attention"
        )
    if cfg.attention.window is not None and cfg.attention.qkv_bias:
        raise ConfigError(f"model.attention.qkv_bias=True: {arch} (a sliding window) has no attention biases")
    if set(cfg.mixers) != {"attention"}:
        raise ConfigError(
            f"model mixers {sorted(set(cfg.mixers))}: {arch} has only attention layers; export a model "
            "whose model.layer_pattern is [attention] and that has no model.yoco"
        )
    if cfg.kv_sharing.kind != "none" or cfg.kv_sharing.uses_kv_norm:
        raise ConfigError(
            f"model.kv_sharing.kind={cfg.kv_sharing.kind!r}: {arch} has no cross-layer K/V sharing; "
            "export a model whose every layer has its own K/V (kind none, no kv_norm)"
        )


def to_hf(cfg: ModelConfig, *, bos_id: int | None = None, eos_id: int | None = None, max_positions: int = 8192) -> dict:
    """The Hugging Face `LlamaForCausalLM` config.json of a kvjax model config (`check_exportable` first);
    `MistralForCausalLM` when the model has a sliding window."""
    att = cfg.attention
    mistral = {"sliding_window": att.window} if att.window is not None else {}
    return {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        **mistral,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": att.n_heads,
        "num_key_value_heads": att.n_kv_heads,
        "head_dim": att.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": att.rope_theta,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": att.qkv_bias,
        "mlp_bias": False,
        **({} if att.rope_scaling is None else {"rope_scaling": _llama3(att.rope_scaling)}),
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def _llama3(scaling: RopeScaling) -> dict:
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_positions,
    }

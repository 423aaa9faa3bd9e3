"""Load a local Hugging Face checkpoint directory (config.json + safetensors) of the decoder families
kvjax expresses, Llama, Mistral and Qwen2, as a kvjax model, with its tokenizer (tokenizer.json).

They share kvjax's layout: pre-norm RMSNorm blocks, SwiGLU MLPs, RoPE pairing channel i with
i + head_dim/2, GQA. Mistral's `sliding_window` becomes `attention.window` (both see keys with
q - k < window); Qwen2's query/key/value biases (and Llama's `attention_bias`, when its output
projection's bias is zero, as kvjax's export writes it) become `attention.qkv_bias`. Anything else a
config asks for (RoPE scaling, other activations, a non-zero output bias, per-layer windows) is refused
by name rather than loaded approximately.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from architectures import Decoder
from kvjax.config import AttentionConfig, Config, ConfigError, ModelConfig
from training.families import llama
from training.tokenizer import HFTokenizer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


class HFImportError(ConfigError):
    """A directory that is not a checkpoint kvjax can load, with the reason."""


def is_hf_dir(ref: str | Path) -> bool:
    path = Path(ref)
    return (path / "config.json").is_file() and any((path / w).is_file() for w in WEIGHTS)


def _window(hf: dict) -> int | None:
    if hf["model_type"] == "mistral":
        return hf.get("sliding_window")
    if hf["model_type"] == "qwen2" and hf.get("use_sliding_window"):
        raise HFImportError(
            "use_sliding_window=true: Qwen2's per-layer windows (max_window_layers) are not "
            "expressible in kvjax; use a checkpoint with full attention"
        )
    return None


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The kvjax ModelConfig of a Hugging Face config.json; refuses what kvjax cannot express."""
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise HFImportError(f"{where}: architectures={arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    rope = hf.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the RoPE type here
    for key, value, ok in (
        ("hidden_act", hf.get("hidden_act"), lambda v: v in (None, "silu")),
        ("rope_scaling", hf.get("rope_scaling"), lambda v: v is None),
        ("rope_parameters.rope_type", rope.get("rope_type"), lambda v: v in (None, "default")),
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
        ),
    )


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if (path / WEIGHTS[0]).is_file():
        files = [path / WEIGHTS[0]]
    else:
        index = json.loads((path / WEIGHTS[1]).read_text())
        files = [path / f for f in sorted(set(index["weight_map"].values()))]
    out = {}
    for f in files:
        out.update({k: np.asarray(v, np.float32) for k, v in load_file(f).items()})
    return out


def load_hf_model(directory: str | Path) -> tuple[Config, Decoder]:
    """A kvjax Decoder (fp32) with the checkpoint's weights, and the Config describing it."""
    path = Path(directory)
    if not is_hf_dir(path):
        raise HFImportError(f"{path}: not a Hugging Face checkpoint (config.json and {' or '.join(WEIGHTS)})")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), str(path))
    w = _tensors(path)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set below

    def put(variable, name: str, transpose: bool = False):
        if name not in w:
            raise HFImportError(f"{path}: tensor {name} is missing")
        value = w[name].T if transpose else w[name]
        if variable.shape != value.shape:
            raise HFImportError(f"{path}: {name} has shape {value.shape}, kvjax expects {variable.shape}")
        variable.set_value(jnp.asarray(value, variable.dtype))

    for weight in llama.weights(cfg):
        put(llama.parameter(model, weight.ours), weight.hf, weight.transpose)
    for i in range(cfg.n_layers):  # Llama's attention_bias also biases o_proj: only zeros map exactly
        if np.any(w.get(f"model.layers.{i}.self_attn.o_proj.bias", 0.0)):
            raise HFImportError(
                f"{path}: model.layers.{i}.self_attn.o_proj.bias is not zero; kvjax's output projection has no bias"
            )
    return Config(model=cfg), model


def load_hf_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer.json behind kvjax's interface, BOS/EOS from its configs."""
    from tokenizers import Tokenizer as HFTok

    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise HFImportError(f"{path}: no tokenizer.json (kvjax reads the fast-tokenizer file)")
    tok = HFTok.from_file(str(path / "tokenizer.json"))
    hf = json.loads((path / "config.json").read_text())
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = hf.get("bos_token_id")
    return HFTokenizer(tok, bos_id=eos if bos is None else bos, eos_id=eos if eos is not None else bos)

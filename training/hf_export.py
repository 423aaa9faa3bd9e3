"""Write a kvjax Llama-family model as a Hugging Face `LlamaForCausalLM` directory (config.json plus
model.safetensors), so that other tools run the same weights. kvjax and Hugging Face share the RoPE
channel pairing (i with i + head_dim/2), so weights are only transposed to [out, in], never permuted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from architectures import Decoder
from kvjax.config import ConfigError
from training.families import llama


def hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """Hugging Face Llama parameter names -> fp32 arrays in PyTorch's [out, in] layout."""
    cfg = model.config
    if cfg.attention.window is not None:
        raise ConfigError(
            f"model.attention.window={cfg.attention.window}: LlamaForCausalLM has no sliding window; export a "
            "model with full causal attention"
        )
    if set(cfg.mixers) != {"attention"}:
        raise ConfigError(
            f"model mixers {sorted(set(cfg.mixers))}: LlamaForCausalLM has only attention layers; export a model "
            "whose model.layer_pattern is [attention] and that has no model.yoco"
        )
    if cfg.kv_sharing.kind != "none" or cfg.kv_sharing.uses_kv_norm:
        raise ConfigError(
            f"model.kv_sharing.kind={cfg.kv_sharing.kind!r}: LlamaForCausalLM has no cross-layer K/V sharing; "
            "export a model whose every layer has its own K/V (kind none, no kv_norm)"
        )
    arr = lambda v: np.asarray(v[...], np.float32)  # noqa: E731
    out = {}
    for weight in llama.weights(cfg):
        value = arr(llama.parameter(model, weight.ours))
        out[weight.hf] = value.T if weight.transpose else value
    if cfg.attention.qkv_bias:  # Llama's attention_bias also biases o_proj: zeros there keep it exact
        out.update(
            {f"model.layers.{i}.self_attn.o_proj.bias": np.zeros(cfg.d_model, np.float32) for i in range(cfg.n_layers)}
        )
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_config(
    model: Decoder, *, bos_id: int | None = None, eos_id: int | None = None, max_positions: int = 8192
) -> dict:
    cfg, att = model.config, model.config.attention
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def export_llama(model: Decoder, out_dir: str | Path, **config_kwargs) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors`; returns out_dir."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(model, **config_kwargs), indent=2))
    return out_dir

"""Write a kvjax model as a Hugging Face directory (config.json plus model.safetensors) of the family
that expresses it (`LlamaForCausalLM`, `MistralForCausalLM` with a sliding window,
`Qwen3ForCausalLM` with q/k norms, `Gemma3ForCausalLM`, or `Phi3ForCausalLM` when asked), so that other tools run the
same weights. kvjax and Hugging Face share the RoPE channel pairing (i with i + head_dim/2), so weights
are only transposed to [out, in], never permuted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvjax.architectures import Decoder
from kvjax.config import ConfigError
from kvjax.training.families import exporting
from kvjax.training.families.llama import parameter


def hf_state_dict(model: Decoder, architecture: str | None = None) -> dict[str, np.ndarray]:
    """Hugging Face parameter names -> fp32 arrays in PyTorch's [out, in] layout, for `architecture`
    (default: the family of the model's block, `families.exporting`)."""
    cfg = model.config
    family = exporting(cfg, architecture)
    family.check_exportable(cfg)
    arr = lambda v: np.asarray(v[...], np.float32)  # noqa: E731
    out, fused = {}, {}
    for weight in family.weights(cfg):
        value = arr(parameter(model, weight.ours))
        value = value.T if weight.transpose else value
        if weight.hf_rows is None:
            out[weight.hf] = value
        else:  # one part of a fused tensor: the parts are joined in row order below
            fused.setdefault(weight.hf, []).append((weight.hf_rows[0], value))
    for name, parts in fused.items():
        out[name] = np.concatenate([value for _, value in sorted(parts, key=lambda part: part[0])])
    if cfg.attention.qkv_bias:  # `attention_bias` also biases o_proj: zeros there keep it exact
        out.update(
            {f"model.layers.{i}.self_attn.o_proj.bias": np.zeros(cfg.d_model, np.float32) for i in range(cfg.n_layers)}
        )
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export_hf(model: Decoder, out_dir: str | Path, architecture: str | None = None, **config_kwargs) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors`; returns out_dir. `architecture` picks
    a family that shares the model's block (`Phi3ForCausalLM` for a Llama-layout model); `config_kwargs`
    (`bos_id`, `eos_id`, `max_positions`) go to the config."""
    from safetensors.numpy import save_file

    family = exporting(model.config, architecture)
    family.check_exportable(model.config)
    config = family.to_hf(model.config, **config_kwargs)
    if architecture not in (None, *config["architectures"]):  # a family writes one of its names per layout
        raise ConfigError(f"architecture={architecture!r}: kvjax writes this model as {config['architectures'][0]}")
    weights = hf_state_dict(model, architecture)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir

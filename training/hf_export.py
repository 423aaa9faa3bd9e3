"""Write a kvjax model as a Hugging Face directory (config.json plus model.safetensors) of the family
that expresses it (`LlamaForCausalLM`, or `Qwen3ForCausalLM` with q/k norms), so that other tools run the
same weights. kvjax and Hugging Face share the RoPE channel pairing (i with i + head_dim/2), so weights
are only transposed to [out, in], never permuted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvjax.architectures import Decoder
from kvjax.training.families import exporting
from kvjax.training.families.llama import parameter


def hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """Hugging Face parameter names -> fp32 arrays in PyTorch's [out, in] layout."""
    cfg = model.config
    family = exporting(cfg)
    family.check_exportable(cfg)
    arr = lambda v: np.asarray(v[...], np.float32)  # noqa: E731
    out = {}
    for weight in family.weights(cfg):
        value = arr(parameter(model, weight.ours))
        out[weight.hf] = value.T if weight.transpose else value
    if cfg.attention.qkv_bias:  # `attention_bias` also biases o_proj: zeros there keep it exact
        out.update(
            {f"model.layers.{i}.self_attn.o_proj.bias": np.zeros(cfg.d_model, np.float32) for i in range(cfg.n_layers)}
        )
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export_hf(model: Decoder, out_dir: str | Path, **config_kwargs) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors`; returns out_dir. `config_kwargs`
    (`bos_id`, `eos_id`, `max_positions`) go to the config."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = exporting(model.config).to_hf(model.config, **config_kwargs)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir

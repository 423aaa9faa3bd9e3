"""The Qwen3 family (`Qwen3ForCausalLM`, GGUF `qwen3`): Llama's layout plus QK-norm, one RMSNorm over
head_dim applied to every query and key head before RoPE (`model.attention.qk_norm`; Qwen3 technical
report, arXiv 2505.09388, sec. 2; transformers' `Qwen3Attention`). llama.cpp's converter does not
permute Qwen's Q/K rows (Qwen's RoPE pairs channel i with i + head_dim/2, as kvjax's does). Qwen3's
optional sliding-window layers (`use_sliding_window`) are refused by name.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import ModelConfig
from kvjax.training.families import HFImportError, llama
from kvjax.training.families.llama import Weight

HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3",)


def weights(cfg: ModelConfig) -> list[Weight]:
    """Llama's tensors (Q/K rows not permuted in GGUF files), then each layer's query and key norms."""
    out = [dataclasses.replace(w, rope_heads=None) for w in llama.weights(cfg)]
    for i in range(cfg.n_layers):
        for name in ("q", "k"):
            ours, hf = f"blocks.{i}.mixer.{name}_norm.scale", f"model.layers.{i}.self_attn.{name}_norm.weight"
            out.append(Weight(ours, hf, f"blk.{i}.attn_{name}_norm.weight"))
    return out


def _with_qk_norm(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, qk_norm=True))


def from_hf(hf: dict, where: str) -> ModelConfig:
    """The kvjax ModelConfig of a `Qwen3ForCausalLM` config.json."""
    if hf.get("use_sliding_window"):
        raise HFImportError(
            f"{where}: use_sliding_window=true: Qwen3's per-layer windows (max_window_layers) are not "
            "expressible in kvjax; use a checkpoint with full attention"
        )
    return _with_qk_norm(llama.from_hf(hf, where))


def from_gguf(field, tensors: set[str], n_tokens: int | None, path) -> ModelConfig:
    """The kvjax ModelConfig of a GGUF `qwen3` file's metadata."""
    return _with_qk_norm(llama.from_gguf(field, tensors, n_tokens, path))


def exports(cfg: ModelConfig) -> bool:
    return llama.plain_block(cfg) and cfg.attention.qk_norm


def check_exportable(cfg: ModelConfig) -> None:
    llama.check_exportable(cfg, "Qwen3ForCausalLM")


def to_hf(cfg: ModelConfig, **kwargs) -> dict:
    """The `Qwen3ForCausalLM` config.json of a kvjax model config (`check_exportable` first)."""
    return {**llama.to_hf(cfg, **kwargs), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}

"""The Gemma 2 family (`Gemma2ForCausalLM`; Gemma Team 2024, arXiv 2408.00118, sec. 2; transformers'
`Gemma2Model`): Gemma 3's block without q/k norms (`gemma3.py` reads and writes both), a global layer
after every local one (window 4,096), one RoPE base for both kinds, and soft-capped logits: attention
logits `50 tanh(x / 50)` (`model.attention.softcap`, in kvjax.ops) and final logits `30 tanh(x / 30)`
(`model.final_softcap`). GGUF `gemma2` files are not read.
"""

from __future__ import annotations

from kvjax.config import ModelConfig
from kvjax.training.families import gemma3

HF_ARCHITECTURES = ("Gemma2ForCausalLM",)
GGUF_ARCHITECTURES = ()


def weights(cfg: ModelConfig):
    """Gemma 3's tensors without the q/k norms."""
    return [w for w in gemma3.weights(cfg) if not w.ours.endswith(("q_norm.scale", "k_norm.scale"))]


def from_hf(hf: dict, where: str) -> ModelConfig:
    """The kvjax ModelConfig of a `Gemma2ForCausalLM` config.json."""
    return gemma3.from_hf(hf, where, qk_norm=False, every=2)


def exports(cfg: ModelConfig) -> bool:
    return cfg.norm_offset == 1.0 and cfg.sandwich_norms and not cfg.attention.qk_norm


def check_exportable(cfg: ModelConfig) -> None:
    gemma3.check_exportable(cfg, "Gemma2ForCausalLM")


def to_hf(cfg: ModelConfig, **kwargs) -> dict:
    """The `Gemma2ForCausalLM` config.json of a kvjax model config (`check_exportable` first)."""
    return gemma3.to_hf(cfg, gemma3=False, **kwargs)

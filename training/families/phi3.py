"""The Phi-3 family (`Phi3ForCausalLM`; Abdin et al. 2024, arXiv 2404.14219; transformers' `Phi3Attention`
and `Phi3MLP`): Llama's block with two fused projections, `qkv_proj` (the rows of Q, then K, then V) and
`gate_up_proj` (gate rows, then up rows), and Mistral's sliding window (`sliding_window`: a query sees
the keys with q - k < window). Refused by name: `longrope` (`su`) RoPE scaling (Phi-3's 128k checkpoints
rescale frequencies by a per-pair factor that switches with the sequence length), a partial rotary
factor below 1 (Phi-4-mini), biases. A kvjax model exports as Phi-3 when asked for by name
(`export_hf(..., architecture="Phi3ForCausalLM")`); by default Llama's layout writes it as Llama (or
Mistral, with a window). GGUF `phi3` files are not read.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import ConfigError, ModelConfig
from kvjax.training.families import HFImportError, llama
from kvjax.training.families.llama import Weight

HF_ARCHITECTURES = ("Phi3ForCausalLM",)
GGUF_ARCHITECTURES = ()
BY_NAME = True  # Llama's block: written as Phi-3 only when asked for (`families.exporting`)
FUSED = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}


def weights(cfg: ModelConfig) -> list[Weight]:
    """Llama's tensors, with Q/K/V and gate/up as row ranges of the fused `qkv_proj` and `gate_up_proj`."""
    att = cfg.attention
    q, kv, ffn = att.n_heads * att.head_dim, att.n_kv_heads * att.head_dim, cfg.ffn_dim
    rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, ffn), "up": (ffn, 2 * ffn)}
    out = []
    for w in llama.weights(cfg):
        name = w.ours.split(".")[-2]
        if w.ours.startswith("blocks.") and name in FUSED:
            layer = w.hf.split(".")[2]
            module = "self_attn" if name in ("q", "k", "v") else "mlp"
            w = dataclasses.replace(w, hf=f"model.layers.{layer}.{module}.{FUSED[name]}.weight", hf_rows=rows[name])
        out.append(dataclasses.replace(w, gguf=None, rope_heads=None))
    return out


def from_hf(hf: dict, where: str) -> ModelConfig:
    """The kvjax ModelConfig of a `Phi3ForCausalLM` config.json; refuses what kvjax cannot express."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type"))
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    for key, value, ok in (
        ("rope_scaling.type", kind, lambda v: v in (None, "default")),
        ("partial_rotary_factor", partial, lambda v: v == 1.0),
        ("attention_bias", hf.get("attention_bias"), lambda v: not v),
        ("head_dim", hf.get("head_dim"), lambda v: v in (None, hf["hidden_size"] // hf["num_attention_heads"])),
    ):
        if not ok(value):
            raise HFImportError(f"{where}: {key}={value!r} is not expressible in kvjax (Phi-3 with default RoPE)")
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    plain["rope_theta"] = hf.get("rope_theta") or rope.get("rope_theta") or 10_000.0
    cfg = llama.from_hf(plain, where)
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=hf.get("sliding_window")))


def exports(cfg: ModelConfig) -> bool:
    return llama.exports(cfg)


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse, naming the field, what `Phi3ForCausalLM` cannot express (Llama's block without biases,
    RoPE scaling or a head_dim other than d_model / n_heads)."""
    att = cfg.attention
    for field, value, ok in (
        ("attention.qkv_bias", att.qkv_bias, not att.qkv_bias),
        ("attention.rope_scaling", att.rope_scaling, att.rope_scaling is None),
        ("attention.head_dim", att.head_dim, att.head_dim * att.n_heads == cfg.d_model),
    ):
        if not ok:
            raise ConfigError(f"model.{field}={value!r}: Phi3ForCausalLM cannot express it (see check_exportable)")
    llama.check_exportable(cfg, "Phi3ForCausalLM")


def to_hf(cfg: ModelConfig, **kwargs) -> dict:
    """The `Phi3ForCausalLM` config.json of a kvjax model config (`check_exportable` first)."""
    shape = llama.to_hf(cfg, **kwargs)
    for llama_only in ("attention_bias", "mlp_bias", "head_dim", "sliding_window"):
        shape.pop(llama_only, None)
    return {
        **shape,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "sliding_window": cfg.attention.window,
        "pad_token_id": None,  # Phi3Config's default (32000) is an id only Phi-3's own vocabulary has
    }

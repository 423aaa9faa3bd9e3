"""The Llama family (Llama, Mistral, Qwen2 and GGUF `llama` files such as SmolLM2): which kvjax parameter
each stored tensor is, named as Hugging Face checkpoints and as llama.cpp's GGUF files name it.

Hugging Face and GGUF store projections as [out, in], kvjax as [in, out] (`transpose`). llama.cpp's
converter also permutes the rows of Q and K so that RoPE rotates adjacent channel pairs; kvjax (like
Hugging Face) rotates channel i with i + head_dim/2, so those rows are un-permuted on import (`rope`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Weight:
    """One stored tensor: its kvjax parameter path (`blocks.3.mixer.q.kernel`), its Hugging Face and GGUF
    names (None: not stored there), whether it is stored transposed, and (GGUF) the heads whose RoPE
    rows llama.cpp permuted."""

    ours: str
    hf: str | None
    gguf: str | None
    transpose: bool = False
    rope_heads: int | None = None


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

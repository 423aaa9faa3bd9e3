"""Write a kvjax model as a Hugging Face directory (config.json plus model.safetensors) of the family
that expresses it (`LlamaForCausalLM`, `MistralForCausalLM` with a sliding window,
`Qwen3ForCausalLM` with q/k norms, `Gemma3ForCausalLM`, or `Phi3ForCausalLM` when asked), so that other tools run the
same weights, and its tokenizer as tokenizer.json (the byte-level one of runs trained here included).
kvjax and Hugging Face share the RoPE channel pairing (i with i + head_dim/2), so weights are only
transposed to [out, in], never permuted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvjax.architectures import Decoder
from kvjax.config import ConfigError
from kvjax.training.families import exporting
from kvjax.training.families.llama import parameter
from kvjax.training.tokenizer import ByteTokenizer, HFTokenizer


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


def export_tokenizer(tokenizer, out_dir: str | Path, *, max_length: int | None = None) -> list[Path]:
    """Write `out_dir/tokenizer.json` (the fast-tokenizer file transformers and kvjax read) and
    `out_dir/tokenizer_config.json` (BOS, EOS, the chat template, the context); returns both paths."""
    if isinstance(tokenizer, HFTokenizer):
        fast, template = tokenizer.tokenizer, tokenizer.chat_template
    elif isinstance(tokenizer, ByteTokenizer):
        fast, template = byte_level(), None
    else:
        raise ConfigError(f"a {type(tokenizer).__name__} has no Hugging Face form kvjax can write")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fast.id_to_token(tokenizer.bos_id),
        "eos_token": fast.id_to_token(tokenizer.eos_id),
        **({"model_max_length": max_length} if max_length else {}),
        **({"chat_template": template} if template else {}),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"]


def byte_level():
    """kvjax's byte tokenizer (`ByteTokenizer`: ids 0-255 the UTF-8 bytes, 256 BOS, 257 EOS) as a
    `tokenizers.Tokenizer`: a BPE vocabulary of the 256 bytes (GPT-2's printable stand-ins for them) and
    no merges, so every byte is its own token with its own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)}
    fast = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<eos>", special=True)])
    assert (fast.token_to_id("<bos>"), fast.token_to_id("<eos>")) == (ByteTokenizer.bos_id, ByteTokenizer.eos_id)
    return fast

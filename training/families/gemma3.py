"""The Gemma 3 family (`Gemma3ForCausalLM` text checkpoints, GGUF `gemma3`; Gemma 3 technical report,
arXiv 2503.19786, sec. 2; transformers' `Gemma3TextModel`): local sliding-window layers interleaved with
global ones (`layer_types`; the default pattern is five local per global layer), each kind with its own
RoPE base (`rope_parameters`: 10,000 local, 1,000,000 global), QK-norm, sandwich norms, GELU-tanh
gated MLPs, embeddings scaled by sqrt(d_model), logits scaled by `query_pre_attn_scalar`^-0.5 and a
tied head. Every RMSNorm scales by 1 + weight (`model.norm_offset` 1); llama.cpp's converter stores
1 + weight in GGUF files, so the GGUF names carry that shift. Q/K rows are not permuted (NeoX RoPE).
Attention logit soft-capping (`attn_logit_softcapping`, None in Gemma 3's configs) is read as Gemma 2's.
Refused by name: bidirectional attention, RoPE scaling (Gemma 3 4B and larger scale their global layers'
RoPE by 8), attention biases.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import AttentionConfig, ConfigError, ModelConfig
from kvjax.kinds.attention import LocalAttentionConfig
from kvjax.training.families import HFImportError, llama
from kvjax.training.families.llama import Weight

HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
GGUF_ARCHITECTURES = ("gemma3",)
KINDS = {"sliding_attention": "local", "full_attention": "attention"}  # HF layer type -> kvjax mixer


def weights(cfg: ModelConfig) -> list[Weight]:
    """Every tensor: embeddings, final norm, per layer four norms and the q/k norms (stored plus one in
    GGUF files), and Llama's names for Q, K, V, O and the MLP (Q/K rows not permuted)."""
    norm = lambda ours, hf, gguf: Weight(ours, hf, gguf, gguf_shift=1.0)  # noqa: E731
    out = [norm("final_norm.scale", "model.norm.weight", "output_norm.weight")]
    for i in range(cfg.n_layers):
        hf, gg, ours = f"model.layers.{i}.", f"blk.{i}.", f"blocks.{i}."
        for name, theirs, gguf in (
            ("mixer_norm", "input_layernorm", "attn_norm"),
            ("post_mixer_norm", "post_attention_layernorm", "post_attention_norm"),
            ("mlp_norm", "pre_feedforward_layernorm", "ffn_norm"),
            ("post_mlp_norm", "post_feedforward_layernorm", "post_ffw_norm"),
            ("mixer.q_norm", "self_attn.q_norm", "attn_q_norm"),
            ("mixer.k_norm", "self_attn.k_norm", "attn_k_norm"),
        ):
            out.append(norm(f"{ours}{name}.scale", f"{hf}{theirs}.weight", f"{gg}{gguf}.weight"))
    shared = [w for w in llama.weights(cfg) if "norm" not in w.ours]  # embeddings, head, projections, MLP
    return out + [dataclasses.replace(w, rope_heads=None) for w in shared]


def _gemma(cfg_fields: dict, kinds: tuple[str, ...], local: LocalAttentionConfig, att: AttentionConfig) -> ModelConfig:
    return ModelConfig(
        **cfg_fields,
        dtype="float32",
        attention=att,
        layer_pattern=kinds,
        local=local,
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=True,
    )


def from_hf(hf: dict, where: str, *, qk_norm: bool = True, every: int = 6) -> ModelConfig:
    """The kvjax ModelConfig of a `Gemma3ForCausalLM` (text) config.json; refuses what kvjax cannot
    express. Gemma 2 (`gemma2.py`) reads its configs here too: no q/k norms, a global layer every
    second one (`every`, when the file has no `layer_types`), one RoPE base for both kinds."""
    rope = hf.get("rope_parameters") or {}
    per_kind = "full_attention" in rope  # Gemma 3 (transformers 5): a RoPE dict per layer type
    full, sliding = (rope.get("full_attention", {}), rope.get("sliding_attention", {})) if per_kind else (rope, rope)
    for key, value, ok in (
        ("hidden_activation", hf.get("hidden_activation"), lambda v: v in (None, "gelu_pytorch_tanh")),
        ("use_bidirectional_attention", hf.get("use_bidirectional_attention"), lambda v: not v),
        ("attention_bias", hf.get("attention_bias"), lambda v: not v),
        ("rope_scaling", hf.get("rope_scaling"), lambda v: v is None),
        ("rope_parameters.full_attention.rope_type", full.get("rope_type"), lambda v: v in (None, "default")),
        ("rope_parameters.sliding_attention.rope_type", sliding.get("rope_type"), lambda v: v in (None, "default")),
    ):
        if not ok(value):
            raise HFImportError(f"{where}: {key}={value!r} is not expressible in kvjax")
    n_layers, pattern = hf["num_hidden_layers"], hf.get("sliding_window_pattern", every)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
    ]
    if unknown := sorted(set(types) - set(KINDS)):
        raise HFImportError(f"{where}: layer_types {unknown} are not expressible in kvjax (known: {sorted(KINDS)})")
    heads, head_dim = hf["num_attention_heads"], hf.get("head_dim", 256)
    scalar = float(hf.get("query_pre_attn_scalar", 256))
    theta = float(full.get("rope_theta") or hf.get("rope_theta") or (1_000_000.0 if qk_norm else 10_000.0))
    att = AttentionConfig(
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta,
        qk_norm=qk_norm,
        query_scale=None if scalar == head_dim else scalar,
        softcap=hf.get("attn_logit_softcapping"),
    )
    local_theta = float(sliding.get("rope_theta") or hf.get("rope_local_base_freq") or (10_000.0 if qk_norm else theta))
    fields = dict(
        name=where.rstrip("/").split("/")[-1].lower(),
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        final_softcap=hf.get("final_logit_softcapping"),
    )
    local = LocalAttentionConfig(window=hf.get("sliding_window") or 4096, rope_theta=local_theta)
    return _gemma(fields, tuple(KINDS[t] for t in types), local, att)


def from_gguf(field, tensors: set[str], n_tokens: int | None, path) -> ModelConfig:
    """The kvjax ModelConfig of a GGUF `gemma3` file: llama.cpp places a global layer after every five
    local ones and gives local layers RoPE base 10,000 (neither is in the file's metadata)."""
    base = llama.from_gguf(field, tensors, n_tokens, path)
    n = base.n_layers
    kinds = tuple("local" if (i + 1) % 6 else "attention" for i in range(n))
    window = int(field("gemma3.attention.sliding_window"))
    fields = {
        f: getattr(base, f)
        for f in ("name", "vocab_size", "d_model", "n_layers", "ffn_dim", "norm_eps", "tie_embeddings")
    }
    att = dataclasses.replace(base.attention, qk_norm=True)
    return _gemma(fields, kinds, LocalAttentionConfig(window=window, rope_theta=10_000.0), att)


def exports(cfg: ModelConfig) -> bool:
    return cfg.norm_offset == 1.0 and cfg.sandwich_norms and cfg.attention.qk_norm


def check_exportable(cfg: ModelConfig, arch: str = "Gemma3ForCausalLM") -> None:
    """Refuse, naming the field, what `arch` cannot express: local or global attention layers, q/k norms
    (Gemma 3) or none and one RoPE base for both kinds (Gemma 2), GELU-tanh MLPs, scaled embeddings."""
    gemma3 = arch == "Gemma3ForCausalLM"
    if set(cfg.mixers) - {"local", "attention"}:
        raise ConfigError(f"model mixers {sorted(set(cfg.mixers))}: {arch} has local and global attention layers only")
    att, local = cfg.attention, cfg.attention_for("local")
    integer = att.query_scale is None or float(att.query_scale).is_integer()  # query_pre_attn_scalar is an int
    for field, value, ok, want in (
        ("attention.qk_norm", att.qk_norm, att.qk_norm == gemma3, repr(gemma3)),
        ("mlp_act", cfg.mlp_act, cfg.mlp_act == "gelu_tanh", "'gelu_tanh'"),
        ("embed_scale", cfg.embed_scale, cfg.embed_scale, "True"),
        ("attention.qkv_bias", att.qkv_bias, not att.qkv_bias, "False"),
        ("attention.query_scale", att.query_scale, integer, "a whole number (or null: head_dim)"),
        ("local.rope_theta", local.rope_theta, gemma3 or local.rope_theta == att.rope_theta, repr(att.rope_theta)),
    ):
        if not ok:
            raise ConfigError(f"model.{field}={value!r}: {arch} needs {want}")
    llama.check_exportable(dataclasses.replace(cfg, layer_pattern=("attention",), local=None), arch)


def to_hf(cfg: ModelConfig, *, max_positions: int = 32768, gemma3: bool = True, **ids) -> dict:
    """The `Gemma3ForCausalLM` (`gemma3` False: `Gemma2ForCausalLM`) config.json of a kvjax model config
    (`check_exportable` first): Llama's shape fields, then Gemma's own (`ids`: `bos_id`, `eos_id`)."""
    att, local = cfg.attention, cfg.attention_for("local")
    shape = llama.to_hf(cfg, max_positions=max_positions, **ids)
    for llama_only in ("hidden_act", "rope_theta", "attention_bias", "mlp_bias"):
        del shape[llama_only]
    per_kind = {
        "full_attention": {"rope_type": "default", "rope_theta": att.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": local.rope_theta},
    }
    return {
        **shape,
        "architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
        "model_type": "gemma3_text" if gemma3 else "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(att.query_scale or att.head_dim),  # an int in Gemma3TextConfig
        "sliding_window": local.window,
        "layer_types": [{"local": "sliding_attention", "attention": "full_attention"}[k] for k in cfg.mixers],
        "rope_parameters": per_kind if gemma3 else per_kind["full_attention"],
        "final_logit_softcapping": cfg.final_softcap,
        "attn_logit_softcapping": att.softcap,
    }

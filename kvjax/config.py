"""Frozen dataclass configs, loaded from YAML with `base:` inheritance and `key.sub=value` overrides.

Every config validates itself on construction, before any compute, and every error names the field,
the bad value and what is allowed (`model.attention.n_kv_heads=3 must divide model.attention.n_heads=8`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from kvjax.errors import ConfigError, positive, require
from kvjax.kinds import KINDS
from kvjax.kinds.attention import LocalAttentionConfig
from kvjax.kinds.mamba import MambaConfig
from kvjax.kinds.mla import MLAConfig
from kvjax.kinds.retention import GRET_FORMS, RetNetConfig
from kvjax.kinds.rwkv import RWKVConfig

DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("xla", "pallas", "cudnn", "splash", "auto")  # kvjax.impls: the attention implementations
KERNEL_IMPLS = ("pallas", "cudnn", "splash")  # those that decode with kvjax's Pallas kernels
MLP_ACTS = ("silu", "gelu_tanh")  # the gated MLP's activation: SwiGLU (Llama), GeGLU with tanh GELU (Gemma)
TRAINABLE = ("all", "kv")  # train.trainable: every parameter, or only the K/V projections and norms
YOCO_SELF_MIXERS = ("swa", "gret")
KV_SHARING_KINDS = ("none", "cla", "mlkv", "explicit")
CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (`rope_type: llama3`; Meta's `apply_scaling`, transformers'
    `_compute_llama3_parameters`): wavelengths longer than original_max_positions / low_freq_factor are
    divided by `factor`, shorter than original_max_positions / high_freq_factor kept, and those between
    interpolated smoothly. Attention itself is not rescaled."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        p = "model.attention.rope_scaling"
        positive(p, self, "factor", "low_freq_factor", "original_max_positions")
        require(
            self.high_freq_factor > self.low_freq_factor,
            f"{p}.high_freq_factor",
            self.high_freq_factor,
            f"must be > low_freq_factor={self.low_freq_factor}",
        )


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Self-attention shape: MHA, GQA and MQA differ only in n_kv_heads; `window` turns on SWA."""

    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 16
    rope_theta: float = 10_000.0
    window: int | None = None
    impl: str = "xla"
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2's attention)
    qk_norm: bool = False  # RMSNorm over head_dim of every query and key head, before RoPE (Qwen3, Gemma 3)
    query_scale: float | None = None  # logits scaled by query_scale^-0.5, not head_dim^-0.5 (Gemma's
    # query_pre_attn_scalar)
    rope_scaling: RopeScaling | None = None  # Llama 3.1's frequency scaling (None: plain RoPE)
    softcap: float | None = None  # scaled logits become softcap * tanh(logits / softcap) (Gemma 2)

    def __post_init__(self):
        p = "model.attention"
        positive(p, self, "n_heads", "n_kv_heads")
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"{p}.n_kv_heads",
            self.n_kv_heads,
            f"must divide {p}.n_heads={self.n_heads}",
        )
        require(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"{p}.head_dim",
            self.head_dim,
            "must be a positive even number (RoPE rotates pairs of channels)",
        )
        positive(p, self, "rope_theta")
        require(
            self.window is None or self.window > 0,
            f"{p}.window",
            self.window,
            "must be > 0, or null for full causal attention",
        )
        require(self.impl in ATTENTION_IMPLS, f"{p}.impl", self.impl, f"must be one of {ATTENTION_IMPLS}")
        positive(p, self, "query_scale", "softcap", optional=True)
        require(
            self.softcap is None or self.impl not in KERNEL_IMPLS,
            f"{p}.impl",
            self.impl,
            f"decodes with kvjax's Pallas kernels, which have no logit soft-capping ({p}.softcap={self.softcap}); "
            "use xla or auto",
        )


@dataclasses.dataclass(frozen=True)
class YOCOConfig:
    """YOCO (Sun et al. 2024, arXiv 2405.05254): the first n_layers/2 layers are a self-decoder of
    `self_mixer` layers (`swa`: sliding-window attention over a `window`-slot ring; `gret`: gated
    retention, trained in `gret_form` with chunks of `chunk` tokens); the last n_layers/2 form a
    cross-decoder whose layers all attend to one global K/V, computed once from the normed self-decoder
    output by the first cross layer."""

    self_mixer: str = "swa"
    window: int = 64
    gret_form: str = "chunkwise"
    chunk: int = 64

    def __post_init__(self):
        p = "model.yoco"
        require(
            self.self_mixer in YOCO_SELF_MIXERS,
            f"{p}.self_mixer",
            self.self_mixer,
            f"must be one of {YOCO_SELF_MIXERS}",
        )
        positive(p, self, "window", "chunk")
        require(self.gret_form in GRET_FORMS, f"{p}.gret_form", self.gret_form, f"must be one of {GRET_FORMS}")


def check_kv_source(kv_source: tuple[int, ...], field: str) -> None:
    """A valid sharing map: every source points back (or to itself) at a layer that is its own source,
    so the first layer always produces."""
    for i, src in enumerate(kv_source):
        require(0 <= src <= i, f"{field}[{i}]", src, f"must be in [0, {i}] (sources point back)")
        require(
            kv_source[src] == src,
            f"{field}[{i}]",
            src,
            f"names layer {src}, which is not a producer (its kv_source is {kv_source[src]})",
        )


def mlkv_producers(n_layers: int, n_kv_layers: int) -> tuple[int, ...]:
    """MLKV's placement (Zuhri et al. 2024, sec. 3): layer 0 plus int((i+1) * L / m) for i < m-1, i.e. the
    m KV layers spread evenly from the bottom of the stack; m = L puts K/V in every layer."""
    return (0, *(int((i + 1) * n_layers / n_kv_layers) for i in range(n_kv_layers - 1)))


@dataclasses.dataclass(frozen=True)
class KVSharingConfig:
    """Which layers compute K/V and which attend to an earlier layer's cache (DESIGN.md, "one layer plan").

    - `none`: every layer produces its own K/V;
    - `cla` (Brandon et al. 2024): producers at layers 0, factor, 2*factor, ...; each other layer reads the
      producer just below it;
    - `mlkv` (Zuhri et al. 2024): `n_kv_layers` producers placed by `mlkv_producers`; each other layer
      reads the nearest producer below it;
    - `explicit`: the `kv_source` list itself (kv_source[i] == i produces).
    `kv_norm` gives producers a separate RMSNorm on the K/V input (as CLA does); null turns it on for
    `cla` with factor > 1 and off otherwise.
    """

    kind: str = "none"
    factor: int | None = None
    n_kv_layers: int | None = None
    kv_source: tuple[int, ...] | None = None
    kv_norm: bool | None = None

    def __post_init__(self):
        p = "model.kv_sharing"
        require(self.kind in KV_SHARING_KINDS, f"{p}.kind", self.kind, f"must be one of {KV_SHARING_KINDS}")
        needs = {"cla": "factor", "mlkv": "n_kv_layers", "explicit": "kv_source"}.get(self.kind)
        for name in ("factor", "n_kv_layers", "kv_source"):
            value = getattr(self, name)
            if name == needs:
                require(value is not None, f"{p}.{name}", value, f"must be set for kind={self.kind!r}")
            else:
                require(value is None, f"{p}.{name}", value, f"is not used by kind={self.kind!r}; remove it")
        if self.kind in ("cla", "mlkv"):
            positive(p, self, needs)
        if self.kind == "explicit":
            check_kv_source(self.kv_source, f"{p}.kv_source")

    def kv_source_for(self, n_layers: int) -> tuple[int, ...]:
        """The per-layer source map for a stack of `n_layers` (validated by ModelConfig)."""
        if self.kind == "explicit":
            return self.kv_source
        if self.kind == "none":
            producers = range(n_layers)
        elif self.kind == "cla":
            producers = range(0, n_layers, self.factor)
        else:
            producers = mlkv_producers(n_layers, self.n_kv_layers)
        return tuple(max(p for p in producers if p <= i) for i in range(n_layers))

    @property
    def uses_kv_norm(self) -> bool:
        if self.kv_norm is not None:
            return self.kv_norm
        return self.kind == "cla" and self.factor > 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM: embeddings, `n_layers` pre-norm blocks (mixer + gated MLP), final norm, head.

    Gemma's choices are options: `norm_offset` (every RMSNorm scales by offset + weight; Gemma stores
    weight = scale - 1), `sandwich_norms` (a norm on the mixer's and on the MLP's output too, before the
    residual add), `mlp_act` (GELU-tanh), `embed_scale` (embeddings times sqrt(d_model)) and
    `final_softcap` (logits c * tanh(logits / c), Gemma 2)."""

    name: str = "model"
    vocab_size: int = 264
    d_model: int = 128
    n_layers: int = 4
    ffn_dim: int = 384
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"
    init_std: float = 0.02
    attention: AttentionConfig = AttentionConfig()
    kv_sharing: KVSharingConfig = KVSharingConfig()
    layer_pattern: tuple[str, ...] = ("attention",)
    yoco: YOCOConfig | None = None
    # The layer kinds' own sections (`Kind.section`; the dataclass lives in the kind's module): each is
    # filled with its defaults when a layer of its kind is present, and null otherwise.
    local: LocalAttentionConfig | None = None
    mla: MLAConfig | None = None
    mamba: MambaConfig | None = None
    rwkv: RWKVConfig | None = None
    retnet: RetNetConfig | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    mlp_act: str = "silu"
    embed_scale: bool = False
    final_softcap: float | None = None

    def __post_init__(self):
        positive("model", self, "vocab_size", "d_model", "n_layers", "ffn_dim", "norm_eps", "init_std")
        require(self.mlp_act in MLP_ACTS, "model.mlp_act", self.mlp_act, f"must be one of {MLP_ACTS}")
        positive("model", self, "final_softcap", optional=True)
        require(self.dtype in DTYPES, "model.dtype", self.dtype, f"must be one of {DTYPES}")
        pattern_kinds = tuple(name for name, kind in KINDS.items() if kind.in_pattern)  # YOCO places the rest
        require(
            bool(self.layer_pattern) and all(kind in pattern_kinds for kind in self.layer_pattern),
            "model.layer_pattern",
            list(self.layer_pattern),
            f"must be a non-empty list of mixer kinds from {pattern_kinds} (repeated to fill model.n_layers)",
        )
        self._kind_sections()
        if "rwkv" in self.layer_pattern:
            require(
                self.d_model % self.rwkv.head_size == 0,
                "model.rwkv.head_size",
                self.rwkv.head_size,
                f"must divide model.d_model={self.d_model}",
            )
        if self.yoco is not None:
            require(
                self.n_layers >= 2 and self.n_layers % 2 == 0,
                "model.n_layers",
                self.n_layers,
                "must be even and >= 2 for YOCO (half self-decoder, half cross-decoder)",
            )
            for field, value, default, why in (
                ("layer_pattern", self.layer_pattern, ("attention",), "YOCO places its own mixers"),
                ("kv_sharing.kind", self.kv_sharing.kind, "none", "YOCO's cross-decoder defines the sharing"),
                (
                    "attention.window",
                    self.attention.window,
                    None,
                    "the cross-decoder attends globally; set model.yoco.window",
                ),
            ):
                require(value == default, f"model.{field}", value, f"must be {default!r} with model.yoco ({why})")
        if "mla" in self.layer_pattern:
            mla, att = self.mla, self.attention
            require(
                att.n_heads % mla.rope_heads == 0,
                "model.mla.rope_heads",
                mla.rope_heads,
                f"must divide model.attention.n_heads={att.n_heads}",
            )
            require(
                mla.rope_heads == 1 or att.impl not in KERNEL_IMPLS,
                "model.attention.impl",
                att.impl,
                "decodes with kvjax's Pallas kernels, which have none for MLA with several RoPE key heads "
                "(model.mla.rope_heads); use xla or auto",
            )
            if mla.rope_pairs is not None:
                require(
                    len(mla.rope_pairs) == self.n_layers,
                    "model.mla.rope_pairs",
                    len(mla.rope_pairs),
                    f"must have one entry per layer (model.n_layers={self.n_layers})",
                )
                require(
                    all(0 <= k < att.head_dim // 2 for heads in mla.rope_pairs for ks in heads for k in ks),
                    "model.mla.rope_pairs",
                    "...",
                    f"pair indices must be in [0, head_dim/2={att.head_dim // 2})",
                )
            require(
                self.attention.window is None,
                "model.attention.window",
                self.attention.window,
                "must be null for MLA layers (no sliding-window latent cache)",
            )
            require(
                self.kv_sharing.kind == "none",
                "model.kv_sharing.kind",
                self.kv_sharing.kind,
                "must be 'none' for a model with MLA layers (MLA shares K/V through its latent instead)",
            )
        for option in ("rope_scaling", "softcap"):  # read by the attention mixer only
            require(
                getattr(self.attention, option) is None or set(self.mixers) <= {"attention", "local", "swa"},
                f"model.attention.{option}",
                getattr(self.attention, option),
                f"applies to softmax attention layers only (this model's mixers: {sorted(set(self.mixers))})",
            )
        if self.kv_sharing.kind != "none":
            require(
                set(self.layer_pattern) == {"attention"},
                "model.layer_pattern",
                list(self.layer_pattern),
                f"must be ['attention'] with model.kv_sharing.kind={self.kv_sharing.kind!r} (only attention "
                "layers share K/V)",
            )
        share, p = self.kv_sharing, "model.kv_sharing"
        if share.kind == "mlkv":
            require(
                share.n_kv_layers <= self.n_layers,
                f"{p}.n_kv_layers",
                share.n_kv_layers,
                f"must be <= model.n_layers={self.n_layers}",
            )
        if share.kind == "explicit":
            require(
                len(share.kv_source) == self.n_layers,
                f"{p}.kv_source",
                list(share.kv_source),
                f"must have one entry per layer (model.n_layers={self.n_layers})",
            )

    def _kind_sections(self) -> None:
        """Give every kind this model uses its section (its defaults unless set) and drop the others: a
        setting for a kind no layer has would change nothing, so it is refused rather than ignored."""
        used = {KINDS[kind].section for kind in self.mixers}
        for kind in KINDS.values():
            if kind.section is None:
                continue
            if not hasattr(self, kind.section):
                raise TypeError(f"layer kind {kind.name!r}: ModelConfig has no field {kind.section!r} for its section")
            value = getattr(self, kind.section)
            if kind.section in used:
                object.__setattr__(self, kind.section, kind.Config() if value is None else value)
                continue
            default = kind.Config()
            changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(default) if value is not None}
            changed = {k: v for k, v in changed.items() if v != getattr(default, k)}
            require(
                not changed,
                f"model.{kind.section}",
                changed,
                f"configures {kind.name!r} layers, and this model has none (its mixers: {sorted(set(self.mixers))}); "
                f"drop the section (model.{kind.section}=null) or add {kind.name!r} to model.layer_pattern",
            )
            object.__setattr__(self, kind.section, None)

    @property
    def kv_source(self) -> tuple[int, ...]:
        """Per layer, the layer whose K/V it attends to (itself for a producer); see kvjax.plan."""
        if self.yoco is not None:
            half = self.n_layers // 2
            return (*range(half), *(half,) * half)
        return self.kv_sharing.kv_source_for(self.n_layers)

    def uses_kv_norm(self, layer: int) -> bool:
        """Whether producer `layer` feeds its K/V projections through a separate RMSNorm: CLA's producers,
        and YOCO's first cross layer (the global K/V come from the normed self-decoder output)."""
        if self.yoco is not None:
            return layer == self.n_layers // 2
        return self.kv_source[layer] == layer and self.kv_sharing.uses_kv_norm

    def attention_for(self, kind: str) -> AttentionConfig:
        """The attention settings of an attention-type layer: YOCO's `swa` layers get its window, `local`
        layers `model.local`'s window and RoPE base."""
        if kind == "swa":
            return dataclasses.replace(self.attention, window=self.yoco.window)
        if kind == "local":
            theta = self.local.rope_theta or self.attention.rope_theta
            return dataclasses.replace(self.attention, window=self.local.window, rope_theta=theta)
        return self.attention

    @property
    def mixers(self) -> tuple[str, ...]:
        """The mixer kind of every layer: `layer_pattern` repeated (and cut) to `n_layers`, or YOCO's
        self-decoder mixers followed by attention."""
        if self.yoco is not None:
            half = self.n_layers // 2
            return (self.yoco.self_mixer,) * half + ("attention",) * half
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.n_layers))


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """Sampling settings for `kvjax.generate`: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int | None = None

    def __post_init__(self):
        p = "decoding"
        positive(p, self, "max_new_tokens")
        require(self.temperature >= 0, f"{p}.temperature", self.temperature, "must be >= 0 (0 is greedy)")
        require(self.top_k >= 0, f"{p}.top_k", self.top_k, "must be >= 0 (0 turns it off)")
        require(0 < self.top_p <= 1, f"{p}.top_p", self.top_p, "must be in (0, 1] (1 turns it off)")
        require(self.eos_id is None or self.eos_id >= 0, f"{p}.eos_id", self.eos_id, "must be >= 0 or null")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which corpus to train on and how it is cut: whole documents go to validation (see training.data)."""

    corpus: str = "kjv"
    tokenizer: str = "byte"
    seq_len: int = 256
    val_fraction: float = 0.1
    eval_windows: int = 64
    passkey: float = 0.0  # fraction of training rows rewritten as pass-key samples (training.data.TrainingMix)
    passkey_weight: float = 1.0  # loss weight of those samples' answer tokens (an ordinary token weighs 1)
    repeats: float = 0.0  # fraction of training rows replaced by induction rows (training.data.induction_row)

    def __post_init__(self):
        p = "data"
        positive(p, self, "seq_len")
        require(0 < self.val_fraction < 1, f"{p}.val_fraction", self.val_fraction, "must be in (0, 1)")
        positive(p, self, "eval_windows")
        require(0 <= self.passkey <= 1, f"{p}.passkey", self.passkey, "must be a fraction in [0, 1]")
        require(self.passkey_weight > 0, f"{p}.passkey_weight", self.passkey_weight, "must be > 0")
        require(
            self.passkey > 0 or self.passkey_weight == 1,
            f"{p}.passkey_weight",
            self.passkey_weight,
            "applies only with data.passkey > 0 (pass-key samples in the mix); leave it at 1",
        )
        require(0 <= self.repeats <= 1, f"{p}.repeats", self.repeats, "must be a fraction in [0, 1]")
        require(
            self.passkey + self.repeats <= 1,
            f"{p}.repeats",
            self.repeats,
            f"plus data.passkey={self.passkey} must be <= 1 (each row is one kind)",
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr, global-norm clipping."""

    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 0
    trainable: str = "all"  # all, or kv: only K/V projections and K/V norms (what uptraining converted)
    init: str | None = None  # a run directory whose trained weights start this run (a curriculum's earlier stage)
    # Mixed precision: `float32` keeps the weights the optimizer updates (and its moments) in fp32 while
    # the model computes in model.dtype (bf16 compute over fp32 master weights, Micikevicius et al. 2018,
    # arXiv 1710.03740, sec. 3.1); None trains the weights in model.dtype itself.
    master_dtype: str | None = None

    def __post_init__(self):
        p = "train"
        positive(
            p,
            self,
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "log_every",
        )
        require(
            self.batch_size % self.grad_accum == 0,
            f"{p}.grad_accum",
            self.grad_accum,
            f"must divide {p}.batch_size={self.batch_size}",
        )
        positive(p, self, "lr")
        require(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        require(
            0 <= self.warmup_steps < self.steps,
            f"{p}.warmup_steps",
            self.warmup_steps,
            f"must be in [0, {p}.steps={self.steps})",
        )
        require(self.weight_decay >= 0, f"{p}.weight_decay", self.weight_decay, "must be >= 0")
        require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"{p}.b1/b2", (self.b1, self.b2), "must be in [0, 1)")
        positive(p, self, "grad_clip")
        require(self.trainable in TRAINABLE, f"{p}.trainable", self.trainable, f"must be one of {TRAINABLE}")
        require(
            self.master_dtype in (None, "float32"),
            f"{p}.master_dtype",
            self.master_dtype,
            "must be float32 (fp32 master weights under a bf16 model) or null (train the model's own dtype)",
        )

    def warmup_for(self, steps: int) -> int:
        """This warm-up scaled to a run of `steps` (the same fraction of it; at least 1 and below `steps`)."""
        return min(steps - 1, max(1, round(self.warmup_steps * steps / self.steps))) if steps > 1 else 0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes: batch over data x fsdp, parameters over fsdp (largest dim) and tensor (heads,
    MLP hidden). -1 on one axis takes every device the other axes leave."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            require(size > 0 or size == -1, f"mesh.{name}", size, "must be > 0, or -1 for the rest")
        require(list(sizes.values()).count(-1) <= 1, "mesh", sizes, "may have at most one axis set to -1")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one experiment needs; later issues add a compression section."""

    model: ModelConfig = ModelConfig()
    decoding: DecodingConfig = DecodingConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        eos = self.decoding.eos_id
        require(
            eos is None or eos < self.model.vocab_size,
            "decoding.eos_id",
            eos,
            f"must be < model.vocab_size={self.model.vocab_size}",
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with type checks and "did you mean" for unknown keys.


def _check_type(path: str, value: Any, hint: Any) -> Any:
    """Return `value` as type `hint` (ints widen to floats), or raise naming the field."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r} must be a list")
        (item, _) = typing.get_args(hint)
        return tuple(_check_type(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _check_type(path, value, hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a mapping of {hint.__name__} fields")
        return from_dict(hint, value, path)
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise ConfigError(f"{path}={value!r} must be of type {getattr(hint, '__name__', hint)}")


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys with a suggestion."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else key
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{full}'{hint} (allowed: {', '.join(fields)})")
    kwargs = {k: _check_type(f"{path}.{k}" if path else k, v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# YAML files, inheritance and overrides.


def resolve_config_path(name: str | Path) -> Path:
    """A path to an existing YAML file, or a bare name looked up under `configs/models/`."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIG_ROOT / "models" / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    known = sorted(p.stem for p in (CONFIG_ROOT / "models").glob("*.yaml"))
    raise ConfigError(f"config '{name}' is neither a file nor a shipped model config (shipped: {known})")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_yaml_tree(path: Path, shipped: Path | None = None, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a YAML config, merging it over its `base:` file: a path relative to this one or, failing
    that, a file in the `shipped` directory (so a user's file anywhere may say `base: gqa.yaml`)."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"config inheritance cycle: {chain}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    candidates = [path.parent / base] + ([shipped / base] if shipped is not None else [])
    base_path = next((p for p in candidates if p.is_file()), None)
    if base_path is None:
        raise ConfigError(f"{path}: base={base!r} does not exist (looked for {', '.join(map(str, candidates))})")
    return _deep_merge(load_yaml_tree(base_path, shipped, (*_seen, path)), data)


def apply_overrides(tree: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a config tree."""
    tree = dict(tree)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        parts = key.split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = yaml.safe_load(raw) if raw else None
    return tree


def load_config(name: str | Path, overrides: typing.Iterable[str] = ()) -> Config:
    """Load and validate a config file (or shipped name) with command-line overrides."""
    path = resolve_config_path(name)
    tree = load_yaml_tree(path, CONFIG_ROOT / "models")
    model = tree.get("model")
    if isinstance(model, dict) and "name" not in model:  # a variant is named after its file
        tree["model"] = {**model, "name": path.stem}
    return from_dict(Config, apply_overrides(tree, overrides))

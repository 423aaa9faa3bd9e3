"""Convert a trained attention model to another KV architecture: the first step of uptraining.

A conversion is text, stages joined by `+` (e.g. `mqa+cla2`), each `name[:key=value,...]`:

- `gqa:kv_heads=K`, `mqa` (K = 1): fewer KV heads. The K/V projection heads of each contiguous group are
  mean-pooled (Ainslie et al. 2023, sec. 2.2: better than keeping the first head or a random init),
  `pool=first` keeps each group's first head instead; biases (Qwen2's) alike. Queries and outputs are
  unchanged.
- `cla:factor=F` (or `cla2`, `cla3`, ...; Brandon et al. 2024) and `mlkv:layers=M` (Zuhri et al. 2024):
  layers share K/V. The producer of each group gets the group's K/V projections mean-pooled over its
  layers (`merge=mean`; MLKV's code averages the layers' heads too), or keeps its own (`merge=keep`);
  the other layers lose theirs. A CLA producer's separate K/V norm starts as its own pre-norm.
- `swa:window=W`: sliding-window attention; the weights are unchanged.
- `yoco-swa:window=W` (Sun et al. 2024): the lower half becomes windowed self-attention; the upper half
  reads one global K/V, made by the first upper layer from the group's projections (`merge` as above)
  through a K/V norm that starts as that layer's pre-norm.

At no reduction (as many KV heads as before, factor 1, M = n_layers, a window longer than the text) the
converted model computes what the source computes. MHA2MLA-style conversion to MLA is not implemented.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from architectures import Decoder
from kvjax.config import ConfigError, KVSharingConfig, ModelConfig, YOCOConfig

STAGES = ("gqa", "mqa", "cla", "mlkv", "swa", "yoco-swa")
POOLS = ("mean", "first")
MERGES = ("mean", "keep")
_OPTIONS = {"gqa": {"kv_heads", "pool"}, "mqa": {"pool"}, "cla": {"factor", "merge"}, "mlkv": {"layers", "merge"},
            "swa": {"window"}, "yoco-swa": {"window", "merge"}}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A parsed conversion: the target's KV heads, layer sharing, windows, and how weights are merged."""

    kv_heads: int | None = None
    sharing: KVSharingConfig | None = None
    window: int | None = None
    yoco_window: int | None = None
    pool: str = "mean"
    merge: str = "mean"
    text: str = ""

    def target(self, source: ModelConfig) -> ModelConfig:
        """The target model config; refuses, naming the field, what cannot map from `source`."""
        where = f"conversion {self.text!r}"
        if set(source.mixers) != {"attention"}:
            raise ConfigError(f"{where}: the source must be a plain attention model (its mixers: {sorted(set(source.mixers))})")
        if (self.sharing or self.yoco_window) and source.kv_sharing.kind != "none":
            raise ConfigError(f"{where}: the source already shares K/V across layers ({source.kv_sharing.kind})")
        if self.sharing and self.yoco_window:
            raise ConfigError(f"{where}: yoco-swa already shares one K/V across its upper half; drop cla/mlkv")
        att = source.attention
        K = att.n_kv_heads if self.kv_heads is None else self.kv_heads
        if att.n_kv_heads % K:
            divisors = [d for d in range(1, att.n_kv_heads + 1) if att.n_kv_heads % d == 0]
            raise ConfigError(f"{where}: cannot map {att.n_kv_heads} KV heads to kv_heads={K}; a divisor of "
                              f"{att.n_kv_heads} is needed ({', '.join(map(str, divisors))})")
        changes = dict(attention=dataclasses.replace(att, n_kv_heads=K, window=self.window or att.window))
        L = source.n_layers
        if self.sharing is not None:
            limit = self.sharing.factor if self.sharing.kind == "cla" else self.sharing.n_kv_layers
            if limit > L:
                name = "factor" if self.sharing.kind == "cla" else "layers"
                raise ConfigError(f"{where}: {self.sharing.kind} {name}={limit} must be <= n_layers={L}")
            changes["kv_sharing"] = self.sharing
        if self.yoco_window is not None:
            if L % 2:
                raise ConfigError(f"{where}: yoco-swa needs an even number of layers (the source has {L})")
            changes["yoco"] = YOCOConfig(self_mixer="swa", window=self.yoco_window)
        return dataclasses.replace(source, **changes)


def _int(stage: str, key: str, value: str, low: int = 1) -> int:
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < low:
        raise ConfigError(f"conversion stage {stage!r}: {key}={value!r} must be an integer >= {low}")
    return n


def parse_conversion(text: str) -> Conversion:
    """`mqa`, `gqa:kv_heads=1,pool=first`, `cla2`, `mqa+cla:factor=2,merge=keep`, `yoco-swa:window=256` ..."""
    if not text or not text.strip():
        raise ConfigError("conversion '' is empty; write e.g. mqa, cla2 or gqa:kv_heads=1")
    fields: dict = {"text": text}
    for stage in text.split("+"):
        name, _, rest = stage.partition(":")
        if name.startswith("cla") and name[3:].isdigit():
            name, rest = "cla", ",".join(filter(None, [f"factor={name[3:]}", rest]))
        if name.startswith("mla"):
            raise ConfigError(f"conversion stage {stage!r}: MHA2MLA-style conversion to MLA is not implemented yet")
        if name not in STAGES:
            raise ConfigError(f"conversion stage {stage!r}: {name!r} must be one of {STAGES} (or claN)")
        options = dict(item.partition("=")[::2] for item in rest.split(",") if item)
        if unknown := set(options) - _OPTIONS[name]:
            raise ConfigError(f"conversion stage {stage!r}: unknown option(s) {sorted(unknown)}; "
                              f"{name} takes {sorted(_OPTIONS[name])}")
        if "pool" in options:
            if options["pool"] not in POOLS:
                raise ConfigError(f"conversion stage {stage!r}: pool={options['pool']!r} must be one of {POOLS}")
            fields["pool"] = options["pool"]
        if "merge" in options:
            if options["merge"] not in MERGES:
                raise ConfigError(f"conversion stage {stage!r}: merge={options['merge']!r} must be one of {MERGES}")
            fields["merge"] = options["merge"]
        required = {"gqa": "kv_heads", "cla": "factor", "mlkv": "layers", "swa": "window", "yoco-swa": "window"}.get(name)
        if required and required not in options:
            raise ConfigError(f"conversion stage {stage!r}: needs {required}=N (e.g. {name}:{required}=2)")
        if name in ("gqa", "mqa"):
            fields["kv_heads"] = 1 if name == "mqa" else _int(stage, "kv_heads", options["kv_heads"])
        elif name == "cla":
            fields["sharing"] = KVSharingConfig(kind="cla", factor=_int(stage, "factor", options["factor"]))
        elif name == "mlkv":
            fields["sharing"] = KVSharingConfig(kind="mlkv", n_kv_layers=_int(stage, "layers", options["layers"]))
        elif name == "swa":
            fields["window"] = _int(stage, "window", options["window"])
        else:
            fields["yoco_window"] = _int(stage, "window", options["window"])
    return Conversion(**fields)


def pool_heads(kernel, n_kv_heads: int, head_dim: int, pool: str):
    """A K or V projection kernel `[D, K_s*H]` with its K_s heads pooled in contiguous groups down to
    n_kv_heads: the group mean (the GQA paper's choice) or the group's first head."""
    D = kernel.shape[0]
    groups = kernel.reshape(D, n_kv_heads, -1, head_dim)  # [D, K_t, g, H]: heads j*g .. (j+1)*g-1
    pooled = groups.mean(axis=2) if pool == "mean" else groups[:, :, 0]
    return pooled.reshape(D, n_kv_heads * head_dim)


def convert(model: Decoder, conversion: Conversion) -> Decoder:
    """A new Decoder of `conversion.target(model.config)` with the source's weights mapped onto it."""
    source = model.config
    target_cfg = conversion.target(source)
    target = nnx.eval_shape(lambda: Decoder(target_cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set
    att = target_cfg.attention
    kv_source = target_cfg.kv_source

    def kv_param(name: str, part: str, producer: int):
        """The producer's K or V kernel (or bias): its group's projections merged, then heads pooled."""
        group = [i for i, src in enumerate(kv_source) if src == producer]
        layers = group if conversion.merge == "mean" else [producer]
        merged = jnp.mean(jnp.stack([getattr(getattr(model.blocks[i].mixer, name), part)[...] for i in layers]), 0)
        return pool_heads(merged.reshape(-1, merged.shape[-1]), att.n_kv_heads, att.head_dim, conversion.pool)

    def put(variable, value):  # a copy: two parameters must never share a buffer (training donates them)
        variable.set_value(jnp.array(value, variable.dtype, copy=True))

    put(target.embed.embedding, model.embed.embedding[...])
    put(target.final_norm.scale, model.final_norm.scale[...])
    if target.lm_head is not None:
        put(target.lm_head.kernel, model.lm_head.kernel[...])
    for i, (new, old) in enumerate(zip(target.blocks, model.blocks)):
        for norm in ("mixer_norm", "mlp_norm"):
            put(getattr(new, norm).scale, getattr(old, norm).scale[...])
        if new.kv_norm is not None:  # a new K/V norm starts as the layer's own pre-norm
            put(new.kv_norm.scale, old.mixer_norm.scale[...])
        for name in ("gate", "up", "down"):
            put(getattr(new.mlp, name).kernel, getattr(old.mlp, name).kernel[...])
        put(new.mixer.q.kernel, old.mixer.q.kernel[...])
        put(new.mixer.o.kernel, old.mixer.o.kernel[...])
        parts = ("kernel", "bias") if att.qkv_bias else ("kernel",)
        if att.qkv_bias:
            put(new.mixer.q.bias, old.mixer.q.bias[...])
        for name in ("k", "v") if new.mixer.produces_kv else ():
            for part in parts:
                param = getattr(getattr(new.mixer, name), part)
                put(param, kv_param(name, part, i).reshape(param.shape))
    return target

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

- `mla:d_c=R,rope_dims=D[,select=norm|high]` (MHA2MLA, Ji et al. 2025, sec. 3): every layer becomes an
  MLA layer that caches an R-dim latent plus, per source KV head, D RoPE dims. Partial RoPE (sec. 3.1):
  each KV head keeps RoPE on D/2 of its frequency pairs, chosen by the pairs' 2-norm contribution
  (`norm`, the paper's S_2-norm: sum over the group's query heads of mean ||q^(k)|| times mean
  ||k^(k)|| on calibration text) or the highest frequencies (`high`); those dims become the head's
  RoPE key, kept per KV head (`mla.rope_heads`) on their original frequencies (`mla.rope_pairs`). The
  other key dims and the values are factorized jointly (SVD_joint, sec. 3.2): X = [W_k,nope, W_v],
  X = U S V^T, the latent projection U_R, the up-projections S_R V_R^T (singular values all there).

A source with local (sliding-window) layers beside global ones (Gemma 2/3) takes the stages that act on
each layer alone: KV-head pooling, and `swa`, which windows its global layers (the local ones keep their
own window). Layer sharing, YOCO and MLA, which would mix or replace the two kinds, are refused by name.

At no reduction (as many KV heads as before, factor 1, M = n_layers, a window longer than the text; for
MLA every RoPE pair kept and full rank) the converted model computes what the source computes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.config import (
    ConfigError,
    KVSharingConfig,
    ModelConfig,
    YOCOConfig,
)
from kvjax.kinds.mla import MLAConfig

STAGES = ("gqa", "mqa", "cla", "mlkv", "swa", "yoco-swa", "mla")
POOLS = ("mean", "first")
MERGES = ("mean", "keep")
SELECTS = ("norm", "high")  # MHA2MLA's partial-RoPE rules: 2-norm contribution, highest frequencies
_OPTIONS = {
    "gqa": {"kv_heads", "pool"},
    "mqa": {"pool"},
    "cla": {"factor", "merge"},
    "mlkv": {"layers", "merge"},
    "swa": {"window"},
    "yoco-swa": {"window", "merge"},
    "mla": {"d_c", "rope_dims", "select"},
}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A parsed conversion: the target's KV heads, layer sharing, windows, and how weights are merged."""

    kv_heads: int | None = None
    sharing: KVSharingConfig | None = None
    window: int | None = None
    yoco_window: int | None = None
    pool: str = "mean"
    merge: str = "mean"
    mla_rank: int | None = None  # MHA2MLA: the latent's d_c ...
    mla_rope_dims: int = 0  # ... RoPE dims kept per head ...
    mla_select: str = "norm"  # ... and how their pairs are chosen
    text: str = ""

    def target(self, source: ModelConfig, rope_pairs=None) -> ModelConfig:
        """The target model config (for MLA, with the chosen `rope_pairs`); refuses, naming the field,
        what cannot map from `source`."""
        where = f"conversion {self.text!r}"
        mixers = set(source.mixers)
        if not mixers <= {"attention", "local"}:
            raise ConfigError(f"{where}: the source must be an attention model (its mixers: {sorted(mixers)})")
        if "local" in mixers and (self.mla_rank is not None or self.sharing or self.yoco_window):
            stage = "mla" if self.mla_rank is not None else "yoco-swa" if self.yoco_window else self.sharing.kind
            raise ConfigError(
                f"{where}: {stage} does not apply to a source with local (sliding-window) layers beside global ones "
                f"(model.layer_pattern {list(source.layer_pattern)}); pooling KV heads (gqa, mqa) and swa (a window "
                "on the global layers) do"
            )
        if self.mla_rank is not None:
            return self._mla_target(source, rope_pairs, where)
        if (self.sharing or self.yoco_window) and source.kv_sharing.kind != "none":
            raise ConfigError(f"{where}: the source already shares K/V across layers ({source.kv_sharing.kind})")
        if self.sharing and self.yoco_window:
            raise ConfigError(f"{where}: yoco-swa already shares one K/V across its upper half; drop cla/mlkv")
        att = source.attention
        K = att.n_kv_heads if self.kv_heads is None else self.kv_heads
        if self.kv_heads is not None and att.n_kv_heads == 1:
            raise ConfigError(
                f"{where}: the source has one KV head already (MQA, as Gemma 3 270M): there are no heads to pool; "
                "drop the mqa/gqa stage"
            )
        if att.n_kv_heads % K:
            divisors = [d for d in range(1, att.n_kv_heads + 1) if att.n_kv_heads % d == 0]
            raise ConfigError(
                f"{where}: cannot map {att.n_kv_heads} KV heads to kv_heads={K}; a divisor of "
                f"{att.n_kv_heads} is needed ({', '.join(map(str, divisors))})"
            )
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

    def _mla_target(self, source: ModelConfig, rope_pairs, where: str) -> ModelConfig:
        att, D = source.attention, self.mla_rope_dims
        if self.kv_heads or self.sharing or self.window or self.yoco_window:
            raise ConfigError(f"{where}: mla converts the source's own K/V heads; drop the other stages")
        if (
            source.kv_sharing.kind != "none"
            or att.window is not None
            or att.qkv_bias
            or att.qk_norm
            or att.rope_scaling
        ):
            raise ConfigError(
                f"{where}: mla needs a source without K/V sharing, windows, q/k/v biases, q/k norms or RoPE scaling"
            )
        if D % 2 or not 2 <= D <= att.head_dim:
            raise ConfigError(f"{where}: rope_dims={D} must be even and in [2, head_dim={att.head_dim}]")
        columns = att.n_kv_heads * (2 * att.head_dim - D)  # [W_k,nope, W_v]: what the latent factorizes
        if self.mla_rank > min(columns, source.d_model):
            raise ConfigError(
                f"{where}: d_c={self.mla_rank} must be <= {min(columns, source.d_model)}, the rank "
                f"of [W_k,nope, W_v] (min of d_model={source.d_model} and {columns} columns)"
            )
        mla = MLAConfig(
            kv_lora_rank=self.mla_rank,
            q_lora_rank=0,
            qk_nope_head_dim=att.head_dim - D,
            qk_rope_head_dim=D,
            v_head_dim=att.head_dim,
            latent_norm=False,
            absorb=True,
            rope_heads=att.n_kv_heads,
            rope_pairs=rope_pairs,
        )
        return dataclasses.replace(source, layer_pattern=("mla",), mla=mla)


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
        if name not in STAGES:
            raise ConfigError(f"conversion stage {stage!r}: {name!r} must be one of {STAGES} (or claN)")
        if ":" in rest:
            raise ConfigError(
                f"conversion stage {stage!r}: separate options with ',', not ':' (e.g. {name}:{rest.replace(':', ',')})"
            )
        options = dict(item.partition("=")[::2] for item in rest.split(",") if item)
        if unknown := set(options) - _OPTIONS[name]:
            raise ConfigError(
                f"conversion stage {stage!r}: unknown option(s) {sorted(unknown)}; "
                f"{name} takes {sorted(_OPTIONS[name])}"
            )
        if "pool" in options:
            if options["pool"] not in POOLS:
                raise ConfigError(f"conversion stage {stage!r}: pool={options['pool']!r} must be one of {POOLS}")
            fields["pool"] = options["pool"]
        if "merge" in options:
            if options["merge"] not in MERGES:
                raise ConfigError(f"conversion stage {stage!r}: merge={options['merge']!r} must be one of {MERGES}")
            fields["merge"] = options["merge"]
        required = {
            "gqa": ["kv_heads"],
            "cla": ["factor"],
            "mlkv": ["layers"],
            "swa": ["window"],
            "yoco-swa": ["window"],
            "mla": ["d_c", "rope_dims"],
        }.get(name, [])
        if missing := [key for key in required if key not in options]:
            raise ConfigError(
                f"conversion stage {stage!r}: needs {', '.join(f'{k}=N' for k in missing)} "
                f"(e.g. {name}:{','.join(f'{k}=16' for k in required)})"
            )
        if name in ("gqa", "mqa"):
            fields["kv_heads"] = 1 if name == "mqa" else _int(stage, "kv_heads", options["kv_heads"])
        elif name == "cla":
            fields["sharing"] = KVSharingConfig(kind="cla", factor=_int(stage, "factor", options["factor"]))
        elif name == "mlkv":
            fields["sharing"] = KVSharingConfig(kind="mlkv", n_kv_layers=_int(stage, "layers", options["layers"]))
        elif name == "swa":
            fields["window"] = _int(stage, "window", options["window"])
        elif name == "mla":
            fields["mla_rank"] = _int(stage, "d_c", options["d_c"])
            fields["mla_rope_dims"] = _int(stage, "rope_dims", options["rope_dims"])
            if options.get("select", "norm") not in SELECTS:
                raise ConfigError(f"conversion stage {stage!r}: select={options['select']!r} must be one of {SELECTS}")
            fields["mla_select"] = options.get("select", "norm")
        else:
            fields["yoco_window"] = _int(stage, "window", options["window"])
    return Conversion(**fields)


def conversion_for(source: ModelConfig, target: ModelConfig, name: str) -> Conversion:
    """The conversion that turns `source` into a model config `target` of the same shape (d_model,
    layers, heads, head_dim, vocabulary, MLP): its KV heads, layer sharing, window, YOCO or MLA (d_c and
    RoPE dims; the rest of an MLA target's layout is MHA2MLA's). Refuses, naming them, other differences."""
    sa, ta = source.attention, target.attention
    shape = {
        "vocab_size": (source.vocab_size, target.vocab_size),
        "d_model": (source.d_model, target.d_model),
        "n_layers": (source.n_layers, target.n_layers),
        "ffn_dim": (source.ffn_dim, target.ffn_dim),
        "attention.n_heads": (sa.n_heads, ta.n_heads),
        "attention.head_dim": (sa.head_dim, ta.head_dim),
    }
    if differ := [f"model.{k} {a} -> {b}" for k, (a, b) in shape.items() if a != b]:
        raise ConfigError(
            f"target config {name!r} differs from the source in {', '.join(differ)}; a conversion "
            "keeps the shape (give a conversion spec such as mqa or cla2 instead)"
        )
    fields: dict = {"text": name}
    if "mla" in target.mixers:
        return Conversion(mla_rank=target.mla.kv_lora_rank, mla_rope_dims=target.mla.qk_rope_head_dim, text=name)
    if ta.n_kv_heads != sa.n_kv_heads:
        fields["kv_heads"] = ta.n_kv_heads
    if target.kv_sharing.kind != "none":
        fields["sharing"] = target.kv_sharing
    if ta.window is not None:
        fields["window"] = ta.window
    if target.yoco is not None:
        fields["yoco_window"] = target.yoco.window
    return Conversion(**fields)


def pool_heads(kernel, n_kv_heads: int, head_dim: int, pool: str):
    """A K or V projection kernel `[D, K_s*H]` with its K_s heads pooled in contiguous groups down to
    n_kv_heads: the group mean (the GQA paper's choice) or the group's first head."""
    D = kernel.shape[0]
    groups = kernel.reshape(D, n_kv_heads, -1, head_dim)  # [D, K_t, g, H]: heads j*g .. (j+1)*g-1
    pooled = groups.mean(axis=2) if pool == "mean" else groups[:, :, 0]
    return pooled.reshape(D, n_kv_heads * head_dim)


def convert(model: Decoder, conversion: Conversion, calibration: np.ndarray | None = None) -> Decoder:
    """A new Decoder of `conversion.target(model.config)` with the source's weights mapped onto it;
    `calibration` tokens `[n, T]` for MHA2MLA's 2-norm rule."""
    source = model.config
    if conversion.mla_rank is not None:
        conversion.target(source, rope_pairs=None)  # refusals first, before any compute
        pairs = rope_pairs(model, conversion.mla_rope_dims // 2, conversion.mla_select, calibration)
        return _to_mla(model, conversion.target(source, rope_pairs=pairs))
    target_cfg = conversion.target(source)
    target = nnx.eval_shape(lambda: Decoder(target_cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set
    att = target_cfg.attention
    kv_source = target_cfg.kv_source

    def merged(name: str, part: str, producer: int):
        """A parameter of the producer's attention, averaged over its group's layers (`merge=mean`)."""
        group = [i for i, src in enumerate(kv_source) if src == producer]
        layers = group if conversion.merge == "mean" else [producer]
        return jnp.mean(jnp.stack([getattr(getattr(model.blocks[i].mixer, name), part)[...] for i in layers]), 0)

    def kv_param(name: str, part: str, producer: int):
        """The producer's K or V kernel (or bias): its group's projections merged, then heads pooled."""
        value = merged(name, part, producer)
        return pool_heads(value.reshape(-1, value.shape[-1]), att.n_kv_heads, att.head_dim, conversion.pool)

    _copy_shared(model, target)
    for i, (new, old) in enumerate(zip(target.blocks, model.blocks)):
        if new.kv_norm is not None:  # a new K/V norm starts as the layer's own pre-norm
            put(new.kv_norm.scale, old.mixer_norm.scale[...])
        put(new.mixer.q.kernel, old.mixer.q.kernel[...])
        put(new.mixer.o.kernel, old.mixer.o.kernel[...])
        parts = ("kernel", "bias") if att.qkv_bias else ("kernel",)
        if att.qkv_bias:
            put(new.mixer.q.bias, old.mixer.q.bias[...])
        if att.qk_norm:  # one norm over head_dim, shared by the heads: pooling leaves it as it is
            put(new.mixer.q_norm.scale, old.mixer.q_norm.scale[...])
            if new.mixer.produces_kv:
                put(new.mixer.k_norm.scale, merged("k_norm", "scale", i))
        for name in ("k", "v") if new.mixer.produces_kv else ():
            for part in parts:
                param = getattr(getattr(new.mixer, name), part)
                put(param, kv_param(name, part, i).reshape(param.shape))
    return target


def rope_pairs(model: Decoder, p: int, select: str, calibration: np.ndarray | None) -> tuple:
    """Per layer and KV head, the p frequency pairs (sorted) that keep RoPE: the highest frequencies
    (pairs 0..p-1), or MHA2MLA's 2-norm rule on calibration tokens: for KV head j and pair k (channels
    k and k + head_dim/2), the sum over the group's query heads of mean_t ||q_h^(k)|| times
    mean_t ||k_j^(k)||; a pair's norm does not change under rotation, so pre-RoPE projections serve."""
    att, L = model.config.attention, model.config.n_layers
    G, half = att.n_kv_heads, att.head_dim // 2
    if select == "high":
        return tuple(tuple(tuple(range(p)) for _ in range(G)) for _ in range(L))
    if calibration is None:
        raise ConfigError(
            "mla with select=norm ranks RoPE pairs on calibration text; pass calibration tokens "
            "(kvjax uptrain takes them from the corpus) or use select=high"
        )
    tokens = jnp.asarray(calibration)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def pair_norms(x, heads):  # [B,T,heads*d_h] -> mean over tokens of each pair's norm [heads, d_h/2]
        x = x.reshape(*x.shape[:2], heads, 2, half).astype(jnp.float32)
        return jnp.sqrt((x**2).sum(axis=3)).mean(axis=(0, 1))

    @jax.jit
    def scores(x, params):
        block = nnx.merge(graphdef, params)
        h = block.mixer_norm(x)
        q = pair_norms(block.mixer.q(h), att.n_heads).reshape(G, -1, half).sum(axis=1)
        return q * pair_norms(block.mixer.k(h), G), block(x, positions)[0]

    x, chosen = model.embed_tokens(tokens), []
    for block in model.blocks:
        graphdef, params = nnx.split(block)
        score, x = scores(x, params)
        top = np.argsort(-np.asarray(score), axis=1, kind="stable")[:, :p]
        chosen.append(tuple(tuple(int(k) for k in sorted(row)) for row in top))
    return tuple(chosen)


def _to_mla(model: Decoder, target_cfg: ModelConfig) -> Decoder:
    """MHA2MLA's weight mapping (see the module docstring) onto a Decoder of MLA layers."""
    att, mla = model.config.attention, target_cfg.mla
    N, G, d_h, D, r = att.n_heads, att.n_kv_heads, att.head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    target = nnx.eval_shape(lambda: Decoder(target_cfg, rngs=nnx.Rngs(0)))

    _copy_shared(model, target)
    for layer, (new, old) in enumerate(zip(target.blocks, model.blocks)):
        rope = [[k for k in ks] + [k + d_h // 2 for k in ks] for ks in mla.rope_pairs[layer]]  # channels, per KV head
        nope = [[c for c in range(d_h) if c not in dims] for dims in rope]
        head = lambda w, heads: np.asarray(w[...], np.float64).reshape(-1, heads, d_h)  # noqa: E731
        q, k, v = head(old.mixer.q.kernel, N), head(old.mixer.k.kernel, G), head(old.mixer.v.kernel, G)
        group = [h * G // N for h in range(N)]  # query head h's KV head
        put(new.mixer.q.kernel, np.concatenate([q[:, h, nope[j] + rope[j]] for h, j in enumerate(group)], axis=1))
        put(new.mixer.k_rope.kernel, np.concatenate([k[:, j, rope[j]] for j in range(G)], axis=1))
        joint = np.concatenate([k[:, j, nope[j]] for j in range(G)] + [v.reshape(v.shape[0], -1)], axis=1)
        u, s, vt = np.linalg.svd(joint, full_matrices=False)
        put(new.mixer.kv_down.kernel, u[:, :r])
        up = s[:r, None] * vt[:r]  # [r, G*(d_h-D) + G*d_h]: the singular values all in the up-projection
        k_up, v_up = up[:, : G * (d_h - D)].reshape(r, G, -1), up[:, G * (d_h - D) :].reshape(r, G, d_h)
        put(new.mixer.k_up.kernel, np.concatenate([k_up[:, j] for j in group], axis=1))
        put(new.mixer.v_up.kernel, np.concatenate([v_up[:, j] for j in group], axis=1))
        put(new.mixer.o.kernel, old.mixer.o.kernel[...])
    return target


def put(variable, value) -> None:
    """Set a parameter to a copy of value: two parameters must never share a buffer (training donates them)."""
    variable.set_value(jnp.array(value, variable.dtype, copy=True))


def _copy_shared(model: Decoder, target: Decoder) -> None:
    """Embeddings, final norm, head, and every block's norms and MLP: the same in every conversion."""
    put(target.embed.embedding, model.embed.embedding[...])
    put(target.final_norm.scale, model.final_norm.scale[...])
    if target.lm_head is not None:
        put(target.lm_head.kernel, model.lm_head.kernel[...])
    for new, old in zip(target.blocks, model.blocks):
        for norm in ("mixer_norm", "mlp_norm", "post_mixer_norm", "post_mlp_norm"):
            if getattr(new, norm) is not None:  # the post norms: Gemma's sandwich
                put(getattr(new, norm).scale, getattr(old, norm).scale[...])
        for name in ("gate", "up", "down"):
            put(getattr(new.mlp, name).kernel, getattr(old.mlp, name).kernel[...])

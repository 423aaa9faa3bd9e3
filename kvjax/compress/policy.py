"""Compression policies: which scorer, allocator and reducer run, with what budget and when.

A policy is a chain of stages written `method:budget[:key=value,...]` joined by `+`, for example
`snapkv:0.5`, `streaming:512:sinks=4`, `h2o:0.5:every=1`, `snapkv:0.5:allocator=adakv,reducer=kvmerger`
or `streaming:0.5+snapkv:0.5`. Quantizers are `method:bits` and come last: `kivi:2`, `int:8`,
`snapkv:0.5+kivi:4` (evict, then quantize what is kept), `int:4:asym` (a boolean option alone means true).
`duo:0.5` (DuoAttention, alone) turns that fraction of KV heads into streaming heads (`kvjax.duo`);
`minicache:0.5` (MiniCache, alone) merges the top half of the layers in pairs (`kvjax.compress.minicache`);
`snapkv:0.5+think:0.4` (ThinK, last) drops 40% of the key channels of what eviction kept;
`d2o:0.5` (D2O) is H2O at every decode step with layer budgets from attention density and merging of
what it evicts (`kvjax.compress.d2o`).

Budget convention (one for every method): a number below 1 is a **ratio**, the fraction of the cached
tokens removed (kvpress's `compression_ratio`; a row of L tokens keeps int(L * (1 - ratio))); an
integer >= 1 is a **size**, the tokens kept per sequence. A chain applies its stages in order, each
to what the previous one kept, so keep fractions multiply (0.5 then 0.5 keeps a quarter).

When it runs: every stage compresses once after the prefill; `every=n` on the last stage also holds its
budget during decoding, evicting back to it every n steps (the cache holds budget + n slots).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from kvjax.compress.methods import METHODS
from kvjax.config import ConfigError, Note
from kvjax.quant import QuantSpec
from kvjax.quant.schemes import SCHEMES

SELECTORS = ("quest",)  # selects pages at attention time instead of scoring slots
# Scoring methods, ThinK's channel scoring, the low-rank caches (`palu:ratio`, `lorc:ratio`: every token
# kept as a rank-r latent) and DuoAttention (`duo:ratio`: that fraction of KV heads keeps only sinks and
# a recent window) are registered by name in kvjax.compress.methods, one module each: `registered(kind)`
# lists them, including any a user registers.
LAYER_LEVEL = ("minicache",)  # `minicache:ratio`: that fraction of layers merged in pairs (compress.minicache)
ALLOCATORS = ("uniform", "pyramid", "adakv")
REDUCERS = ("select", "cam", "kvmerger")
POOLINGS = ("avg", "max")
# Tokens always kept, per method: StreamingLLM's attention sinks and recent window (Xiao et al. 2024);
# H2O's recent half of the budget (Zhang et al. 2023, equal heavy and recent budgets); SnapKV's
# observation window (Li et al. 2024, w = 32). `window=None` means the method's own rule.
# DuoAttention's deployment recent window (reference eval scripts); ThinK's unpruned recent prompt tokens
_DEFAULT_RECENT = {"duo": 256, "think": 32}


def registered(kind: str) -> tuple[str, ...]:
    """The registered methods of a kind: "scorer" (token scores), "channels" (ThinK), "low_rank" (Palu,
    LoRC) or "head_level" (DuoAttention)."""
    return tuple(name for name, method in METHODS.items() if method.kind == kind)


def all_methods() -> tuple[str, ...]:
    """Every method a policy stage may name."""
    low_rank, head_level = registered("low_rank"), registered("head_level")
    return (
        registered("scorer") + SELECTORS + tuple(SCHEMES) + low_rank + registered("channels") + head_level + LAYER_LEVEL
    )


@dataclasses.dataclass(frozen=True)
class Stage:
    """One compression step. `window` None: the method's rule (StreamingLLM: the rest of the budget,
    H2O: half of it, SnapKV: `obs_window`, others: 0)."""

    method: str
    ratio: float | None = None
    size: int | None = None
    sinks: int | None = None
    window: int | None = None
    allocator: str = "uniform"
    reducer: str = "select"
    every: int = 0
    obs_window: int = (
        32  # SnapKV: the last prompt queries that vote; ThinK: queries scoring channels; Scissorhands: history
    )
    kernel: int = 5  # SnapKV: 1-D pooling kernel over neighbouring slots
    pooling: str = "avg"
    normalize: bool = False  # H2O: divide by the number of queries that saw each key (kvpress)
    beta: float = 20.0  # PyramidKV: the top layer keeps budget / beta
    floor: float = 0.2  # AdaKV: each head keeps at least floor x its uniform share
    sigma: float = 1.0  # KVMerger: Gaussian kernel width over unit-key distances
    page_size: int = 16  # Quest: tokens per page
    bits: int = 0  # int / kivi / kvquant: code width
    asym: bool = False  # int: per-token min-max codes with a zero point (else symmetric)
    group: int | None = None  # KIVI / GEAR: tokens per key group, channels per value group (32; GEAR 64)
    residual: int | None = None  # KIVI / KVQuant / GEAR: full-precision recent tokens (128; GEAR 64)
    outliers: float | None = None  # KVQuant: fraction of each vector kept exactly (0.01; GEAR 0.02)
    rank: int = 4  # GEAR: rank of the quantization error's approximation per block and head
    heads: int = 4  # Palu: KV heads per low-rank group
    pattern: str = ""  # DuoAttention: the learned gates (JSON); "" = the model's own (see kvjax.duo)
    t: float = 0.6  # MiniCache: SLERP interpolation between the lower (0) and upper (1) layer
    retain: float = 0.05  # MiniCache: fraction of tokens per head whose originals are kept unmerged
    ema: float = 0.5  # D2O: weight of the old merge threshold in its moving average

    def __post_init__(self):
        where = f"policy stage {self.method!r}"
        methods = all_methods()
        if self.method not in methods:
            raise ConfigError(f"{where}: method={self.method!r} must be one of {methods}")
        low_rank_error = self.quantizes and SCHEMES[self.method].low_rank
        if self.rank != 4 and not low_rank_error or self.rank < 0:
            with_rank = ", ".join(name for name, s in SCHEMES.items() if s.low_rank)
            raise ConfigError(f"{where}: rank={self.rank} must be >= 0, and applies to {with_rank} only")
        if self.quantizes:
            try:
                self.quant_spec
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
            if self.every or self.allocator != "uniform" or self.reducer != "select":
                raise ConfigError(
                    f"{where}: a quantizer keeps every token; every=, allocator= and reducer= do not apply"
                )
            return
        if self.asym:
            raise ConfigError(f"{where}: asym applies to int quantization only")
        if (self.ratio is None) == (self.size is None):
            raise ConfigError(f"{where}: give exactly one budget, a ratio in [0, 1) or a size >= 1")
        if self.ratio is not None and not 0 <= self.ratio < 1:
            raise ConfigError(f"{where}: ratio={self.ratio} must be in [0, 1) (the fraction of tokens removed)")
        if self.size is not None and self.size < 1:
            raise ConfigError(f"{where}: size={self.size} must be >= 1 (tokens kept)")
        for name, allowed in (("allocator", ALLOCATORS), ("reducer", REDUCERS), ("pooling", POOLINGS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{where}: {name}={getattr(self, name)!r} must be one of {allowed}")
        for name in ("sinks", "window", "every"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{where}: {name}={value} must be >= 0")
        for name in ("obs_window", "kernel", "page_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: {name}={getattr(self, name)} must be >= 1")
        if self.kernel % 2 == 0:
            raise ConfigError(f"{where}: kernel={self.kernel} must be odd (centred pooling)")
        if self.beta < 1 or not 0 <= self.floor <= 1 or self.sigma <= 0:
            raise ConfigError(f"{where}: beta={self.beta} must be >= 1, floor={self.floor} in [0, 1], sigma > 0")
        if self.reducer == "cam" and self.method in ("streaming", "keynorm", "quest"):
            raise ConfigError(f"{where}: reducer='cam' weighs merges by attention; use h2o, snapkv or tova")
        if self.method in registered("low_rank") + registered("channels") and self.ratio is None:
            raise ConfigError(f"{where}: give the fraction of K/V dimensions removed, a ratio in [0, 1)")
        if self.heads < 1:
            raise ConfigError(f"{where}: heads={self.heads} must be >= 1")
        if self.pattern and self.method != "duo":
            raise ConfigError(f"{where}: pattern= applies to duo only")
        if self.method == "duo":
            if self.ratio is None:
                raise ConfigError(f"{where}: give the fraction of KV heads that stream, a ratio in [0, 1)")
            if self.recent < 1 or self.n_sinks < 0:
                raise ConfigError(f"{where}: window={self.window} (recent tokens) must be >= 1")
            if any(c in self.pattern for c in ":,+"):
                raise ConfigError(f"{where}: pattern={self.pattern!r} may not contain ':', ',' or '+'")
        if self.method == "minicache":
            if self.ratio is None:
                raise ConfigError(f"{where}: give the fraction of layers merged, a ratio in [0, 1)")
            if not 0 <= self.t <= 1 or not 0 <= self.retain <= 1:
                raise ConfigError(f"{where}: t={self.t} and retain={self.retain} must be in [0, 1]")
        elif self.t != 0.6 or self.retain != 0.05:
            raise ConfigError(f"{where}: t= and retain= apply to minicache only")
        if self.method == "d2o":
            if self.allocator != "uniform" or self.reducer != "select" or self.normalize:
                raise ConfigError(
                    f"{where}: D2O brings its own layer budgets and merge; allocator=, reducer= and "
                    "normalize= do not apply"
                )
            if not 0 <= self.ema <= 1 or self.ratio is None:
                raise ConfigError(
                    f"{where}: give the fraction of tokens removed on average, a ratio in [0, 1); "
                    f"ema={self.ema} must be in [0, 1]"
                )
            if not self.every:  # D2O evicts (and merges) at every decode step
                object.__setattr__(self, "every", 1)
        elif self.ema != 0.5:
            raise ConfigError(f"{where}: ema= applies to d2o only")
        if self.method in ("quest", "think", "duo", "minicache", *registered("low_rank")) and (
            self.every or self.allocator != "uniform" or self.reducer != "select"
        ):
            raise ConfigError(
                f"{where}: every=, allocator= and reducer= do not apply to {self.method} (it evicts no token by score)"
            )

    @property
    def n_sinks(self) -> int:
        if self.sinks is not None:
            return self.sinks
        return METHODS[self.method].sinks if self.method in METHODS else 0

    def n_window(self, keep: int) -> int:
        """Recent tokens always kept when `keep` tokens are kept."""
        if self.window is not None:
            return self.window
        return METHODS[self.method].window(self, keep) if self.method in METHODS else 0

    @property
    def recent(self) -> int:
        """DuoAttention: the recent window a streaming head keeps."""
        return _DEFAULT_RECENT.get(self.method, 0) if self.window is None else self.window

    @property
    def quantizes(self) -> bool:
        return self.method in SCHEMES

    @property
    def encodes(self) -> bool:
        """Keeps every token in another form (quantized codes, a low-rank latent, pruned key channels)."""
        return self.quantizes or self.method in registered("low_rank") + registered("channels")

    @property
    def quant_spec(self):
        sinks = 1 if self.sinks is None else self.sinks
        scheme = SCHEMES[self.method]
        group = scheme.group if self.group is None else self.group
        residual = scheme.residual if self.residual is None else self.residual
        outliers = scheme.outlier_fraction if self.outliers is None else self.outliers
        return QuantSpec(
            self.method,
            self.bits,
            self.asym,
            group,
            residual,
            outliers=outliers,
            sinks=sinks,
            rank=self.rank if scheme.low_rank else 0,
        )

    @property
    def fixed_protected(self) -> int:
        """Sinks plus a window that does not scale with the budget (the least a layer may keep)."""
        if self.window is not None:
            return self.n_sinks + self.window
        return self.n_sinks + (METHODS[self.method].fixed_window(self) if self.method in METHODS else 0)

    def keep(self, length: int) -> int:
        """Tokens this stage keeps of `length`."""
        if self.encodes or self.method in registered("head_level") + LAYER_LEVEL:
            return length
        return int(length * (1 - self.ratio) + 1e-9) if self.ratio is not None else self.size

    @property
    def pooled(self) -> bool:
        return self.allocator == "adakv"

    @property
    def per_head(self) -> bool:
        """Whether heads may keep different tokens (so positions are stored per head)."""
        return self.pooled or (self.method in METHODS and METHODS[self.method].per_head)


@dataclasses.dataclass(frozen=True)
class Policy:
    stages: tuple[Stage, ...]

    def __post_init__(self):
        if not self.stages:
            raise ConfigError("a policy needs at least one stage")
        if len(self.stages) > 1 and any(s.method == "quest" for s in self.stages):
            raise ConfigError("policy stage 'quest' cannot be chained: it selects pages at attention time")
        for stage in self.stages:
            if len(self.stages) > 1 and stage.method in registered("head_level") + LAYER_LEVEL + ("d2o",):
                raise ConfigError(
                    f"policy stage {stage.method!r} cannot be chained: it sets what each head or "
                    "layer stores from the whole prompt"
                )
        for stage in self.stages[:-1]:
            if stage.encodes:
                raise ConfigError(f"policy stage {stage.method!r}: encode last (evict first, then encode what is kept)")
        for stage in self.stages[:-1]:
            if stage.every:
                raise ConfigError(f"policy stage {stage.method!r}: every= is allowed on the last stage only")

    @property
    def decode_stage(self) -> Stage | None:
        """The stage that holds its budget during decoding, if any."""
        return self.stages[-1] if self.stages[-1].every else None

    def __str__(self) -> str:
        return "+".join(_stage_text(s) for s in self.stages)


def _stage_text(stage: Stage) -> str:
    budget = stage.bits if stage.quantizes else stage.ratio if stage.ratio is not None else stage.size
    opts = [
        f"{f.name}={str(getattr(stage, f.name)).lower()}"
        for f in dataclasses.fields(Stage)
        if f.name not in ("method", "ratio", "size", "bits") and getattr(stage, f.name) != f.default
    ]
    return f"{stage.method}:{budget}" + (":" + ",".join(opts) if opts else "")


_OPTION_TYPES = {f.name: f.type for f in dataclasses.fields(Stage)}


def _option(name: str, text: str, where: str):
    kind = _OPTION_TYPES.get(name)
    if kind is None or name in ("method", "ratio", "size", "bits"):
        allowed = sorted(set(_OPTION_TYPES) - {"method", "ratio", "size", "bits"})
        raise ConfigError(f"{where}: unknown option {name!r}; allowed: {allowed}")
    try:
        if "bool" in kind:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"{where}: {name}={text!r} is not a valid {kind}") from None


def parse_stage(text: str) -> Stage:
    where = f"policy stage {text!r}"
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise ConfigError(f"{where}: write method:budget[:key=value,...], e.g. snapkv:0.5 or streaming:512")
    method, budget = parts[0], parts[1]
    try:
        value = float(budget)
    except ValueError:
        raise ConfigError(f"{where}: budget {budget!r} must be a ratio in [0, 1) or a size >= 1") from None
    if value >= 1 and value != int(value):
        raise ConfigError(f"{where}: size {budget!r} must be a whole number of tokens")
    options = {}
    for item in parts[2].split(",") if len(parts) == 3 else ():
        name, eq, raw = item.partition("=")
        if not eq and "bool" in _OPTION_TYPES.get(name.strip(), ""):  # a bare flag: int:4:asym
            eq, raw = "=", "true"
        if not eq:
            raise ConfigError(f"{where}: option {item!r} must be key=value")
        options[name.strip()] = _option(name.strip(), raw.strip(), where)
    if method in SCHEMES:
        return Stage(method, bits=int(value), **options)
    budget_field = {"ratio": value} if value < 1 else {"size": int(value)}
    return Stage(method, **budget_field, **options)


def parse_policy(text: str) -> Policy:
    """`snapkv:0.5`, `h2o:0.25:every=1`, `streaming:0.5+snapkv:0.5` ... (see the module docstring)."""
    if not text or not text.strip():
        raise ConfigError("policy '' is empty; write e.g. snapkv:0.5")
    return Policy(tuple(parse_stage(part) for part in text.split("+")))


class BudgetNote(Note):
    """A ratio budget raised to the tokens its method always keeps (a short prompt, not a bad policy)."""


def stage_counts(stage: Stage, lengths: np.ndarray, n_layers: int) -> np.ndarray:
    """Tokens each compressible layer keeps per row, `[n_layers, B]` (int), from the rows' current
    lengths; checks the budget against sinks + window and the sequence before any compute.

    A ratio is a request: a row whose int(L x (1 - ratio)) falls below what the method always keeps
    (sinks + window, at most the row) keeps those tokens instead, and at least one; a row no longer than
    the protected tokens is not compressed (kvpress keeps a prompt shorter than SnapKV's window whole).
    Each raise is reported once as a `BudgetNote` warning. A size is a contract: one that cannot be
    met is a ConfigError."""
    lengths = np.asarray(lengths, np.int64)
    keep = np.array([stage.keep(int(n)) for n in lengths], np.int64)
    raised = np.zeros(len(keep), bool)
    for row, (n, k) in enumerate(zip(lengths, keep)):
        protected = min(int(n), stage.n_sinks + stage.n_window(int(k)))
        if k > n and not stage.every:  # a decode-time budget is a cap: rows below it keep every token
            raise ConfigError(
                f"policy stage {stage.method!r}: size={k} is above row {row}'s sequence of {n} tokens"
                " (a size budget applies to prompts longer than it; every=n makes it a cap)"
            )
        if stage.ratio is not None and (k < protected or k < 1) and n >= 1:
            keep[row] = k = max(protected, 1)
            raised[row] = True
        if min(k, n) < protected or k < 1:
            sinks, window = stage.n_sinks, stage.n_window(int(k))
            capped = f", capped at the row's {n} tokens" if protected < sinks + window else ""
            raise ConfigError(
                f"policy stage {stage.method!r}: row {row} ({n} tokens) would keep {k}, below the {protected} "
                f"tokens always kept (sinks {sinks} + window {window}{capped}); raise the budget "
                f"or lower sinks/window"
            )
    if raised.any():
        fixed = stage.fixed_protected
        warnings.warn(
            BudgetNote(
                f"policy stage {_stage_text(stage)}: on short rows ratio={stage.ratio} would keep fewer tokens than "
                f"the {max(fixed, 1)} it always keeps (sinks {stage.n_sinks} + window {fixed - stage.n_sinks}); those "
                f"rows keep them instead, and a row of at most {max(fixed, 1)} tokens is not compressed"
            ),
            stacklevel=2,
        )
    counts = np.broadcast_to(keep, (n_layers, len(keep))).copy()
    if stage.allocator == "pyramid" and n_layers > 1:  # a raised row keeps its protected tokens in every layer
        counts = np.stack(
            [counts[:, b] if raised[b] else pyramid_counts(stage, int(n), n_layers) for b, n in enumerate(lengths)],
            axis=1,
        )
    return counts


def pyramid_counts(stage: Stage, length: int, n_layers: int) -> np.ndarray:
    """PyramidKV's layer budgets `[n_layers]` for one row of `length` tokens (Cai et al. 2024, arXiv
    2406.02069, sec. 3.3), as kvpress's `PyramidKVPress.get_layer_budget` computes them from the
    official code's rule: with k the mean budget (`length * (1 - ratio)`, or the size) and w the
    stage's fixed window, the budget falls linearly from max = 2k - k/beta at layer 0 to min = k/beta;
    when max exceeds length - w it is capped there and min = 2k - max, so the layers still sum to L x k.
    Each budget is rounded (`round`, as kvpress; the official code floors, which can overshoot the
    total); when the schedule would not hold (min below w, or max above the length) every layer keeps
    round(k), as kvpress falls back to SnapKV."""
    k = length * (1 - stage.ratio) if stage.ratio is not None else float(stage.size)
    w = stage.fixed_protected
    low = k / stage.beta
    high = 2 * k - low
    if high >= length - w:
        high = length - w
        low = 2 * k - high
    if not length >= high >= low >= w:
        return np.full(n_layers, round(k), np.int64)
    step = (high - low) / (n_layers - 1)
    # rounded at 1e-9 first, so float noise cannot tip a .5 (200 x 0.15 = 30.000000000000004) and break the sum
    return np.array([round(round(high - layer * step, 9)) for layer in range(n_layers)], np.int64)

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

Options: `sinks`, `window`, `allocator`, `reducer`, `every` and `local` are any stage's; the chosen allocator's
and reducer's own options (`beta` of `pyramid`, `floor` of `adakv`, `sigma` of `kvmerger`;
`kvjax.compress.allocators`, `kvjax.compress.reducers`) are the stage's when it chooses them; every
other option belongs to its method (its `Options` dataclass, `kvjax.compress.methods`) or quantizer
(from its parts, `kvjax.quant.schemes`), and any other option is an error that lists what the stage takes.

When it runs: every stage compresses once after the prefill; `every=n` on the last stage also holds its
budget during decoding, evicting back to it every n steps (the cache holds budget + n slots).

What it compresses: the caches that grow with the sequence. Sliding-window rings (Gemma's local layers)
are left whole, their memory being capped already, unless the first stage says `local` (`snapkv:0.5:local`):
then each ring's budget is taken of the tokens still inside its window (min(L, W - 1) of them; a size
above that keeps them all), and the layer decodes from a position-masked cache of its kept tokens plus
the new ones, the window still masking what falls out of it. After token eviction that cache holds
min(kept + new, W) slots (`kvjax.cache.WindowKVCache`: once full, a new token goes over the oldest,
which no later query sees), so a compressed ring stays capped however long decoding goes, as an AdaKV
pool does in K W entries (`WindowPooledKVCache`) and one in any quantizer's codes (int, KIVI, KVQuant, GEAR,
after eviction or alone: `kvjax.quant.cache.WindowQuantKVCache`, whose residual must fit the window), and the
caches methods re-encode: Palu's and LoRC's latents, Quest's pages (those W tokens touch, whole) and ThinK's
tail of decoded tokens. Every one is a `kvjax.cache.Ring`.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from kvjax.compress.allocators import ALLOCATORS
from kvjax.compress.methods import METHODS
from kvjax.compress.reducers import REDUCERS
from kvjax.errors import ConfigError, Note
from kvjax.quant import QuantSpec
from kvjax.quant.schemes import SCHEMES

COMMON = ("sinks", "window", "allocator", "reducer", "every", "local")  # options of any stage


def registered(kind: str) -> tuple[str, ...]:
    """The registered methods of a kind: "scorer" (token scores), "channels" (ThinK), "low_rank" (Palu,
    LoRC), "head_level" (DuoAttention), "selector" (Quest) or "layer_level" (MiniCache)."""
    return tuple(name for name, method in METHODS.items() if method.kind == kind)


def all_methods() -> tuple[str, ...]:
    """Every method a policy stage may name: the registered methods, then the quantizers."""
    return tuple(METHODS) + tuple(SCHEMES)


def options_class(method: str) -> type:
    """The dataclass of a method's or quantizer's own options."""
    return SCHEMES[method].Options if method in SCHEMES else METHODS[method].Options


@dataclasses.dataclass(frozen=True)
class Stage:
    """One compression step: the method, its budget (a `ratio` or a `size`; a quantizer's `bits`), what
    every method shares, and the options of the method, the allocator and the reducer (their `Options`
    dataclasses; None: their defaults). `window` None: the method's rule (StreamingLLM: the rest of the
    budget, H2O: half of it, SnapKV: `obs_window`, others: 0). `Stage.of("snapkv", ratio=0.5, kernel=7,
    allocator="pyramid", beta=10)` sorts keywords into their places."""

    method: str
    ratio: float | None = None
    size: int | None = None
    bits: int = 0  # a quantizer's code width
    sinks: int | None = None  # first positions always kept (None: the method's own)
    window: int | None = None  # recent positions always kept (None: the method's rule)
    allocator: str = "uniform"  # how the budget is spread over layers and heads
    reducer: str = "select"  # what happens to the evicted tokens
    every: int = 0  # the last stage holds its budget while decoding, evicting every n steps
    local: bool = False  # (first stage) compress the sliding-window rings too, not only the growing caches
    options: object = None  # the method's own
    allocator_options: object = None
    reducer_options: object = None

    @classmethod
    def of(cls, method: str, **fields) -> Stage:
        """A stage from keywords: the stage's own fields, then the options of the method, the allocator
        and the reducer by their names."""
        own = {f.name for f in dataclasses.fields(cls)}
        options = {name: fields.pop(name) for name in list(fields) if name not in own}
        if options and method in all_methods():
            where = f"policy stage {method!r}"
            allocator, reducer = _part(fields, "allocator", where), _part(fields, "reducer", where)
            _check_names(method, options, where, allocator, reducer)
            for key, part in (("options", None), ("allocator_options", allocator), ("reducer_options", reducer)):
                kind = options_class(method) if part is None else part.Options
                mine = {f.name for f in dataclasses.fields(kind)}
                if chosen := {name: options.pop(name) for name in list(options) if name in mine}:
                    fields[key] = kind(**chosen)
        return cls(method, **fields)

    def __post_init__(self):
        where = f"policy stage {self.method!r}"
        methods = all_methods()
        if self.method not in methods:
            raise ConfigError(f"{where}: method={self.method!r} must be one of {methods}")
        allocator, reducer = _part(vars(self), "allocator", where), _part(vars(self), "reducer", where)
        for key, kind, owner in (
            ("options", options_class(self.method), self.method),
            ("allocator_options", allocator.Options, f"allocator {self.allocator}"),
            ("reducer_options", reducer.Options, f"reducer {self.reducer}"),
        ):
            if getattr(self, key) is None:
                object.__setattr__(self, key, kind())
            elif type(getattr(self, key)) is not kind:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} must be {owner}'s own ({kind.__name__})")
            getattr(self, key).check(where)
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
        if (self.ratio is None) == (self.size is None):
            raise ConfigError(f"{where}: give exactly one budget, a ratio in [0, 1) or a size >= 1")
        if self.ratio is not None and not 0 <= self.ratio < 1:
            raise ConfigError(f"{where}: ratio={self.ratio} must be in [0, 1) (the fraction of tokens removed)")
        if self.size is not None and self.size < 1:
            raise ConfigError(f"{where}: size={self.size} must be >= 1 (tokens kept)")
        for name in ("sinks", "window", "every"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{where}: {name}={value} must be >= 0")
        method = METHODS[self.method]
        if reducer.needs_attention and not method.observed_queries(self, 1):
            raise ConfigError(f"{where}: reducer={self.reducer!r} weighs merges by attention; use h2o, snapkv or tova")
        if method.kind != "scorer" and (self.every or self.allocator != "uniform" or self.reducer != "select"):
            raise ConfigError(
                f"{where}: every=, allocator= and reducer= do not apply to {self.method} (it evicts no token by score)"
            )
        method.validate(self, where)

    def __str__(self) -> str:
        return _stage_text(self)

    @property
    def hooks(self):
        """The registered `Method` of this stage (None for a quantizer, whose parts are its `Scheme`)."""
        return METHODS.get(self.method)

    @property
    def n_sinks(self) -> int:
        if self.sinks is not None:
            return self.sinks
        return self.hooks.sinks if self.hooks else 0

    def n_window(self, keep: int) -> int:
        """Recent tokens always kept when `keep` tokens are kept."""
        if self.window is not None:
            return self.window
        return self.hooks.window(self, keep) if self.hooks else 0

    @property
    def recent(self) -> int:
        """The recent tokens a method that keeps a fixed recent window keeps (DuoAttention's streaming
        heads, ThinK's unpruned tail): `window=`, else the method's `recent`."""
        return METHODS[self.method].recent if self.window is None else self.window

    @property
    def quantizes(self) -> bool:
        return self.method in SCHEMES

    @property
    def encodes(self) -> bool:
        """Keeps every token in another form (quantized codes, a low-rank latent, pruned key channels)."""
        return self.quantizes or METHODS[self.method].kind in ("low_rank", "channels")

    @property
    def quant_spec(self) -> QuantSpec:
        """A quantizer's spec: its code width, its options, and the exact sinks (1 unless `sinks=`)."""
        sinks = 1 if self.sinks is None else self.sinks
        return QuantSpec(self.method, self.bits, sinks=sinks, **dataclasses.asdict(self.options))

    @property
    def fixed_protected(self) -> int:
        """Sinks plus a window that does not scale with the budget (the least a layer may keep)."""
        if self.window is not None:
            return self.n_sinks + self.window
        return self.n_sinks + (self.hooks.fixed_window(self) if self.hooks else 0)

    def keep(self, length: int) -> int:
        """Tokens this stage keeps of `length`."""
        if self.encodes or METHODS[self.method].kind in ("head_level", "layer_level"):
            return length
        return int(length * (1 - self.ratio) + 1e-9) if self.ratio is not None else self.size

    @property
    def allocation(self):
        """The stage's registered allocator (`kvjax.compress.allocators`)."""
        return ALLOCATORS[self.allocator]

    @property
    def reduction(self):
        """The stage's registered reducer (`kvjax.compress.reducers`)."""
        return REDUCERS[self.reducer]

    @property
    def pooled(self) -> bool:
        return self.allocation.pooled

    @property
    def per_head(self) -> bool:
        """Whether heads may keep different tokens (so positions are stored per head)."""
        return self.pooled or bool(self.hooks and self.hooks.per_head)


@dataclasses.dataclass(frozen=True)
class Policy:
    stages: tuple[Stage, ...]

    def __post_init__(self):
        if not self.stages:
            raise ConfigError("a policy needs at least one stage")
        for stage in self.stages:
            if len(self.stages) > 1 and stage.hooks and stage.hooks.alone:
                raise ConfigError(f"policy stage {stage.method!r} cannot be chained: {stage.hooks.alone}")
        for stage in self.stages[:-1]:
            if stage.encodes:
                raise ConfigError(f"policy stage {stage.method!r}: encode last (evict first, then encode what is kept)")
        for stage in self.stages[:-1]:
            if stage.every:
                raise ConfigError(f"policy stage {stage.method!r}: every= is allowed on the last stage only")
        for stage in self.stages[1:]:
            if stage.local:
                raise ConfigError(
                    f"policy stage {stage.method!r}: local= goes on the first stage (the whole chain compresses "
                    "the same caches)"
                )

    @property
    def local(self) -> bool:
        """Whether the policy compresses the sliding-window rings (Gemma's local layers) too."""
        return self.stages[0].local

    @property
    def budgets_at_prefill(self) -> bool:
        """Whether the last stage plans its layers' budgets from each prefill's attention (D2O)."""
        hooks = self.stages[-1].hooks
        return bool(hooks and hooks.budgets_at_prefill)

    @property
    def decode_stage(self) -> Stage | None:
        """The stage that holds its budget during decoding, if any."""
        return self.stages[-1] if self.stages[-1].every else None

    def __str__(self) -> str:
        return "+".join(map(str, self.stages))


def _stage_text(stage: Stage) -> str:
    budget = stage.bits if stage.quantizes else stage.ratio if stage.ratio is not None else stage.size
    changed = [(stage, f) for f in dataclasses.fields(Stage) if f.name in COMMON]
    for options in (stage.options, stage.allocator_options, stage.reducer_options):
        changed += [(options, f) for f in dataclasses.fields(options)]
    opts = [f"{f.name}={str(getattr(obj, f.name)).lower()}" for obj, f in changed if getattr(obj, f.name) != f.default]
    return f"{stage.method}:{budget}" + (":" + ",".join(opts) if opts else "")


def _part(fields: dict, name: str, where: str):
    """The registered allocator or reducer (`name`) that stage fields choose, by its name."""
    registry = {"allocator": ALLOCATORS, "reducer": REDUCERS}[name]
    chosen = fields.get(name) or next(iter(registry))
    if chosen not in registry:
        raise ConfigError(f"{where}: {name}={chosen!r} must be one of {tuple(registry)}")
    return registry[chosen]


def _option_types(method: str, allocator, reducer) -> dict[str, str]:
    """The options a stage of `method` with this allocator and reducer takes, with their types as text:
    the common ones, its own, the allocator's and the reducer's."""
    common = {f.name: f.type for f in dataclasses.fields(Stage) if f.name in COMMON}
    for kind in (options_class(method), allocator.Options, reducer.Options):
        common |= {f.name: f.type for f in dataclasses.fields(kind)}
    return {name: kind if isinstance(kind, str) else kind.__name__ for name, kind in common.items()}


def _check_names(method: str, options, where: str, allocator, reducer) -> None:
    unknown = [name for name in options if name not in _option_types(method, allocator, reducer)]
    if not unknown:
        return
    owners = [
        f"{kind} {part.name}"
        for kind, registry in (("allocator", ALLOCATORS), ("reducer", REDUCERS))
        for part in registry.values()
        if unknown[0] in {f.name for f in dataclasses.fields(part.Options)}
    ]
    if owners:
        raise ConfigError(f"{where}: option {unknown[0]!r} belongs to {owners[0]}; add {owners[0].replace(' ', '=')}")
    own = [f.name for f in dataclasses.fields(options_class(method))]
    raise ConfigError(
        f"{where}: unknown option {unknown[0]!r}; {method}'s own options: {own or 'none'}, and any "
        f"stage's: {list(COMMON)}"
    )


def _option(kind: str, name: str, text: str, where: str):
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
    if method not in all_methods():
        raise ConfigError(f"{where}: method={method!r} must be one of {all_methods()}")
    try:
        value = float(budget)
    except ValueError:
        raise ConfigError(f"{where}: budget {budget!r} must be a ratio in [0, 1) or a size >= 1") from None
    if value >= 1 and value != int(value):
        raise ConfigError(f"{where}: size {budget!r} must be a whole number of tokens")
    items = [item for item in parts[2].split(",")] if len(parts) == 3 else []
    chosen = dict(item.partition("=")[::2] for item in items)
    allocator = _part({k.strip(): v.strip() for k, v in chosen.items()}, "allocator", where)
    reducer = _part({k.strip(): v.strip() for k, v in chosen.items()}, "reducer", where)
    types, options = _option_types(method, allocator, reducer), {}
    for item in items:
        name, eq, raw = (part.strip() for part in item.partition("="))
        _check_names(method, [name], where, allocator, reducer)
        if not eq and "bool" in types[name]:  # a bare flag: int:4:asym
            eq, raw = "=", "true"
        if not eq:
            raise ConfigError(f"{where}: option {item!r} must be key=value")
        options[name] = _option(types[name], name, raw, where)
    if method in SCHEMES:
        return Stage.of(method, bits=int(value), **options)
    budget_field = {"ratio": value} if value < 1 else {"size": int(value)}
    return Stage.of(method, **budget_field, **options)


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
        reads = bool(stage.hooks and stage.hooks.kind == "selector")
        if k > n and not stage.every and not reads:  # a decode-time budget (or Quest's reads) is a cap
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
    if n_layers > 1:  # the allocator spreads the budget; a raised row keeps its protected tokens in every layer
        spread = [
            None if raised[b] else stage.allocation.layer_counts(stage, int(n), n_layers) for b, n in enumerate(lengths)
        ]
        counts = np.stack([counts[:, b] if s is None else s for b, s in enumerate(spread)], axis=1)
    return counts

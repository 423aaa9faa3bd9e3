"""What a quantizer is: the parts of a `QuantKVCache` it switches on, its code widths and defaults."""

from __future__ import annotations

import dataclasses
import functools

from kvjax.options import Options as _Options

SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    """Make `scheme` available to `QuantSpec` and to policies as `name:bits`."""
    if scheme.name in SCHEMES:
        raise ValueError(f"a quantizer named {scheme.name!r} is registered already")
    SCHEMES[scheme.name] = scheme
    return scheme


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A quantizer as parts. Without `blocked`, keys and values get one scale (and, asymmetric, a zero
    point) per token and head; with it, keys are quantized per channel over groups of `group` tokens and
    values per token over channel groups, each block once `residual` full-precision tokens fill it."""

    name: str
    bits: tuple[int, ...]  # code widths allowed
    asym_bits: tuple[int, ...] = ()  # widths allowed with asym=true (empty: no symmetric/asymmetric choice)
    blocked: bool = False  # per-channel key groups through a full-precision residual (KIVI)
    value_grouped: bool = False  # values over groups of `group` channels (else one group: the whole vector)
    outliers: str | None = None  # exact entries per vector: "largest" magnitudes or "extremes" (both ends)
    pre_rope_keys: bool = False  # keys quantized before RoPE and rotated again when read
    exact_sinks: bool = False  # the first `sinks` tokens kept in full precision
    low_rank: bool = False  # a rank-`rank` approximation of each block's quantization error
    group: int = 32  # defaults of the stage options
    residual: int = 128
    outlier_fraction: float = 0.01
    rank: int = 4

    @functools.cached_property
    def Options(self) -> type:  # noqa: N802 (a class, as a method's `Options`)
        """The dataclass of this quantizer's own policy options, from its parts: `asym` where it has a
        symmetric/asymmetric choice, `group` and `residual` when blocked, `outliers` with exact outliers,
        `rank` with a low-rank error; each defaulting to the scheme's value."""
        fields = [("asym", bool, False)] if self.asym_bits else []
        if self.blocked:
            fields += [("group", int, self.group), ("residual", int, self.residual)]
        if self.outliers:
            fields.append(("outliers", float, self.outlier_fraction))
        if self.low_rank:
            fields.append(("rank", int, self.rank))
        fields = [(name, kind, dataclasses.field(default=default)) for name, kind, default in fields]
        return dataclasses.make_dataclass(f"{self.name.title()}Options", fields, bases=(_Options,), frozen=True)

    @property
    def plain(self) -> bool:
        """Codes and scales only: what a kernel that dequantizes as it reads can take as stored."""
        return not (self.outliers or self.pre_rope_keys or self.exact_sinks or self.low_rank)

"""Quantizers, one module each, registered by name (`SCHEMES`): a scheme is the set of parts a
`QuantKVCache` is built from (how keys and values are grouped, exact outliers, pre-RoPE keys, exact
sinks, a low-rank error term) and its defaults. Importing this package imports every module in it, so
a new quantizer made of these parts is one new file here."""

import importlib
import pkgutil

from kvjax.quant.schemes.base import SCHEMES, Scheme, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["SCHEMES", "Scheme", "register"]

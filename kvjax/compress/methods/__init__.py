"""Token-level methods, one module each, registered by name (`METHODS`): importing this package imports
every module in it, so a new scoring method is one new file here (see docs/extending.md): a `Method`
subclass with its defaults, `observe` and `score`, under `@register`."""

import importlib
import pkgutil

from kvjax.compress.methods.base import METHODS, Method, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Method", "register"]

"""kvjax: a JAX research framework for KV-cache-efficient language models.

The names below, and the submodules (`kvjax.memory`, `kvjax.cache`, ...), are imported on first use, so
that `import kvjax.commands` (the command line's `--help`) and `import kvjax.errors` load no JAX."""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "KVCache": "kvjax.cache",
    "RingKVCache": "kvjax.cache",
    "Policy": "kvjax.compress",
    "parse_policy": "kvjax.compress",
    "Config": "kvjax.config",
    "ConfigError": "kvjax.config",
    "DecodingConfig": "kvjax.config",
    "ModelConfig": "kvjax.config",
    "load_config": "kvjax.config",
    "Engine": "kvjax.engine",
    "Request": "kvjax.engine",
    "GenerationResult": "kvjax.generate",
    "Generator": "kvjax.generate",
    "generate": "kvjax.generate",
    "attention": "kvjax.ops",
    "init_caches": "kvjax.plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """`kvjax.generate` is the function (`from kvjax import generate`), not the module of that name: importing
    the submodule, which binds it on its package, must not replace the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

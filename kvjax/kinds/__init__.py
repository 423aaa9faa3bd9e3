"""Layer kinds, one module each, registered by name (`KINDS`): what a layer of the plan caches, how many
bytes that takes, and whether other layers may attend to its K/V. `kvjax.plan` (the layer plan and
`init_caches`), `kvjax.memory` and the decoder look kinds up here; importing this package imports
every module in it."""

import importlib
import pkgutil

from kvjax.kinds.base import INT32, KINDS, Kind, LayerMemory, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["INT32", "KINDS", "Kind", "LayerMemory", "register"]

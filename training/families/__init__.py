"""Model families: each module owns one family's weight names in Hugging Face and GGUF files (both ways)
and its config translation (both ways), so that the importers and the exporter are generic loops;
they look a family up here by the checkpoint's architecture name. Importing this package imports every
module in it and maps the architecture names each declares (`HF_ARCHITECTURES`, `GGUF_ARCHITECTURES`),
so a new family is one new file here; a Hugging Face export asks each family whether it `exports` a
model config (exactly one does)."""

from __future__ import annotations

import importlib
import pkgutil

from kvjax.config import ConfigError


class HFImportError(ConfigError):
    """A directory that is not a checkpoint kvjax can load, with the reason."""


FAMILIES = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]  # after the error
BY_HF_ARCHITECTURE = {name: family for family in FAMILIES for name in family.HF_ARCHITECTURES}
BY_GGUF_ARCHITECTURE = {name: family for family in FAMILIES for name in family.GGUF_ARCHITECTURES}


def exporting(cfg):
    """The family whose Hugging Face architecture writes a model of `cfg` (Qwen3 with q/k norms, else
    Llama); its `check_exportable` then refuses, naming the field, what that architecture lacks."""
    (family,) = [family for family in FAMILIES if family.exports(cfg)]
    return family

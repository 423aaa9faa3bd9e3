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


def exporting(cfg, architecture: str | None = None):
    """The family that writes a model of `cfg` as a Hugging Face directory: among the families whose
    `exports(cfg)` holds (they express its block: Llama's, Qwen3's with q/k norms, Gemma 3's with offset
    sandwich norms), the one named by `architecture`, else the one not marked `BY_NAME` (Phi-3 shares
    Llama's block and is written only when asked for). Its `check_exportable` then refuses, naming the
    field, what that architecture lacks."""
    families = [family for family in FAMILIES if family.exports(cfg)]
    if architecture is not None:
        if BY_HF_ARCHITECTURE.get(architecture) not in families:
            names = [name for family in families for name in family.HF_ARCHITECTURES]
            raise ConfigError(
                f"architecture={architecture!r} does not express model {cfg.name!r}'s block; the ones that do: "
                f"{', '.join(names) or 'none'}"
            )
        return BY_HF_ARCHITECTURE[architecture]
    families = [family for family in families if not getattr(family, "BY_NAME", False)]
    if not families:
        raise ConfigError(
            f"model {cfg.name!r}: no Hugging Face architecture kvjax writes has this block (norm_offset="
            f"{cfg.norm_offset}, sandwich_norms={cfg.sandwich_norms}, mlp_act={cfg.mlp_act!r}, embed_scale="
            f"{cfg.embed_scale}, attention.qk_norm={cfg.attention.qk_norm}); the families: "
            f"{', '.join(name for family in FAMILIES for name in family.HF_ARCHITECTURES)}"
        )
    (family,) = families
    return family

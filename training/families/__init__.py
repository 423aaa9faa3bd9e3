"""Model families: each module owns one family's weight names in Hugging Face and GGUF files (both ways)
and its config translation (both ways), so that the importers and the exporter are generic loops;
they look a family up here by the checkpoint's architecture name."""

from __future__ import annotations

from kvjax.config import ConfigError


class HFImportError(ConfigError):
    """A directory that is not a checkpoint kvjax can load, with the reason."""


from kvjax.training.families import llama  # noqa: E402 (a family raises the error above)

BY_HF_ARCHITECTURE = {name: llama for name in llama.HF_ARCHITECTURES}
BY_GGUF_ARCHITECTURE = {name: llama for name in llama.GGUF_ARCHITECTURES}

"""The tokenizer a config names (`data.tokenizer`): `byte`, or the vocabulary of an imported model. Apart
from `training.tokenizer` so that the importers, which build tokenizers, are not imported back by it."""

from __future__ import annotations

from kvjax.training.gguf_import import load_gguf_tokenizer
from kvjax.training.hf_import import load_hf_tokenizer
from kvjax.training.tokenizer import ByteTokenizer, Tokenizer

TOKENIZERS = {"byte": ByteTokenizer}
GGUF_PREFIX = "gguf:"  # `gguf:smollm2` or `gguf:/path/model.gguf`: the vocabulary a GGUF file carries
HF_PREFIX = "hf:"  # `hf:/path/checkpoint`: a Hugging Face checkpoint directory's tokenizer.json


def get_tokenizer(name: str) -> Tokenizer:
    """`byte`, `gguf:<shipped name or .gguf path>` or `hf:<checkpoint directory>` (an imported model's
    vocabulary, e.g. for uptraining it)."""
    if name.startswith(GGUF_PREFIX):
        return load_gguf_tokenizer(name[len(GGUF_PREFIX) :])
    if name.startswith(HF_PREFIX):
        return load_hf_tokenizer(name[len(HF_PREFIX) :])
    if name not in TOKENIZERS:
        raise ValueError(f"data.tokenizer={name!r} must be one of {sorted(TOKENIZERS)}, gguf:<model> or hf:<directory>")
    return TOKENIZERS[name]()

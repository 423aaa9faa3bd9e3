"""Tokenizers behind one small interface; the byte-level one is the default for models trained here."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """What data loading, evaluation and generation need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        ...

    def decode(self, ids) -> str: ...

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token id stands for (0 for specials): turns nats per token into bits per byte."""
        ...


class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes of the text; 256 is BOS and 257 is EOS."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0, 0], np.int64)


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer={name!r} must be one of {sorted(TOKENIZERS)}")
    return TOKENIZERS[name]()

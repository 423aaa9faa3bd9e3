"""Tokenizers behind one small interface; the byte-level one is the default for models trained here."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvjax.chat import render

# Text read from files keeps bytes that are not valid UTF-8 as lone surrogates (Python's
# "surrogateescape"), so that a byte-level tokenizer sees the file's exact bytes.
FILE_ERRORS = "surrogateescape"


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
    """Ids 0-255 are the UTF-8 bytes of the text (a file's own bytes where it is not UTF-8, see
    FILE_ERRORS); 256 is BOS and 257 is EOS."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", FILE_ERRORS))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0, 0], np.int64)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind kvjax's interface (used for BPE vocabularies)."""

    def __init__(self, tokenizer, *, bos_id: int, eos_id: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template  # the model's own (Jinja) chat format, if it has one

    def chat_turn(self) -> tuple[str, str] | None:
        """The text around one user message, up to where the assistant's reply starts, rendered from the
        model's chat template (its default system prompt included), or None without a template."""
        if not self.chat_template:
            return None
        marker = "\x00message\x00"
        text = self.render_chat([{"role": "user", "content": marker}])
        before, _, after = text.partition(marker)
        return before, after

    def render_chat(self, messages: list[dict], generation: bool = True) -> str:
        """`messages` in the model's chat template (`kvjax.chat.render`, with its BOS and EOS tokens)."""
        return render(
            self.chat_template,
            messages,
            bos=self.tokenizer.id_to_token(self.bos_id) or "",
            eos=self.tokenizer.id_to_token(self.eos_id) or "",
            generation=generation,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids; bytes of a file that are not UTF-8 become U+FFFD (a BPE vocabulary works on text)."""
        text = text.encode("utf-8", FILE_ERRORS).decode("utf-8", "replace")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            piece = self.tokenizer.id_to_token(i)
            if piece is not None and piece not in special:
                out[i] = len(self.tokenizer.decode([i]).encode("utf-8"))
        return out

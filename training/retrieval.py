"""Synthetic retrieval prompts built from corpus filler text, answered by exact match: passkey retrieval
(Mohtashami and Jaggi 2023) and multi-key needles in a haystack (RULER's niah_multikey). Training mixes
(`training.data`), DuoAttention's gate training and the evaluations all build their prompts here."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from kvjax.config import ConfigError

INTRO = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
WORDS = ("apple", "river", "candle", "mirror", "falcon", "harbor", "violet", "marble", "thunder", "lantern")


@dataclasses.dataclass(frozen=True)
class RetrievalCase:
    prompt: list[int]
    answer: str


def haystack(
    tokenizer,
    filler: np.ndarray,
    length: int,
    needles: list[tuple[float, str]],
    question: str,
    bos: bool,
    intro: str = INTRO,
):
    """Intro, filler cut to fit `length` tokens, each needle text inserted at its depth (0..1), question."""
    head = ([tokenizer.bos_id] if bos else []) + tokenizer.encode(intro)
    pieces = [(depth, tokenizer.encode(text)) for depth, text in needles]
    tail = tokenizer.encode(question)
    n_fill = length - len(head) - len(tail) - sum(len(p) for _, p in pieces)
    if n_fill < 1 or n_fill > len(filler):
        fixed = length - n_fill  # intro, needles and question
        raise ConfigError(
            f"length={length} leaves {n_fill} filler tokens around the needles and question, which take {fixed}; "
            f"the length must be {fixed + 1} to {fixed + len(filler)} tokens"
        )
    body = list(filler[:n_fill])
    for depth, ids in sorted(pieces, key=lambda p: -p[0]):  # deepest first, so earlier cuts stay put
        at = int(round(depth * n_fill))
        body[at:at] = ids
    return head + [int(t) for t in body] + tail


def passkey_case(tokenizer, filler, length: int, depth: float, rng: np.random.Generator, bos: bool) -> RetrievalCase:
    """A pass key in corpus text. A chat model (one whose tokenizer has a chat template) gets it as one
    user turn asking for a secret number, and the reply is begun for it: SmolLM2-135M-Instruct answers
    that at 128-1,024 tokens, where it answered the plain pass-key prompt with prose."""
    key = str(rng.integers(10_000, 100_000))
    chat = getattr(tokenizer, "chat_turn", lambda: None)()
    if chat is None:
        needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
        prompt = haystack(tokenizer, filler, length, [(depth, needle)], "\nWhat is the pass key? The pass key is", bos)
        return RetrievalCase(prompt, key)
    before, after = chat
    question = "\n\nWhat is the secret number?" + after + "The secret number is"
    prompt = haystack(
        tokenizer,
        filler,
        length,
        [(depth, f"\nThe secret number is {key}.\n")],
        question,
        bos,
        intro=before + "Read the text and tell me the secret number.\n\n",
    )
    return RetrievalCase(prompt, key)


def needle_case(tokenizer, filler, length: int, depth: float, rng: np.random.Generator, bos: bool, keys: int = 4):
    """RULER-style multi-key needles: `keys` needles spread through the text, the asked one at `depth`."""
    words = list(rng.choice(WORDS, size=keys, replace=False))
    numbers = [str(n) for n in rng.integers(1_000_000, 10_000_000, size=keys)]
    others = [d for d in np.linspace(0, 1, keys + 1)[:-1] + 0.5 / keys if abs(d - depth) > 1e-9][: keys - 1]
    depths = [depth, *others]
    needles = [(d, f" One of the special magic numbers for {w} is: {n}. ") for d, w, n in zip(depths, words, numbers)]
    question = f"\nWhat is the special magic number for {words[0]}? The special magic number for {words[0]} is:"
    return RetrievalCase(haystack(tokenizer, filler, length, needles, question, bos), numbers[0])


def answered(tokenizer, tokens, answer: str) -> bool:
    found = re.search(r"\d+", tokenizer.decode(tokens))
    return found is not None and found.group() == answer

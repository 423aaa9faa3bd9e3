"""What every command's arguments share: one-line usage errors, checked number types, overrides."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, as kvjax's other errors are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type, rule: str, ok):
    """An argparse type: a number of `kind` for which ok(value) holds, else '<value> <rule>'."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} {rule}")
        return value

    return parse


POSITIVE = _number(int, "must be >= 1", lambda v: v >= 1)

NON_NEGATIVE = _number(int, "must be >= 0", lambda v: v >= 0)

NON_NEGATIVE_FLOAT = _number(float, "must be >= 0", lambda v: v >= 0)

POSITIVE_FLOAT = _number(float, "must be > 0", lambda v: v > 0)

UNIT = _number(float, "must be in [0, 1]", lambda v: 0 <= v <= 1)

OPEN_UNIT = _number(float, "must be in (0, 1]", lambda v: 0 < v <= 1)

MODEL_HELP = "a run directory, a Hugging Face checkpoint directory, a .gguf file, or a shipped model (smollm2, gemma3)"
LONG_HELP = "go past the model's trained context (data.seq_len of a run; the GGUF file's context_length)"


def split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments containing '=' are overrides; the rest name configs."""
    return [a for a in items if "=" not in a], [a for a in items if "=" in a]

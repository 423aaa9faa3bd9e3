"""What every command's arguments share: one-line usage errors, checked number types, renamed options,
output paths checked before any compute, overrides. Light by design: `kvjax --help` imports only this."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from kvjax.errors import ConfigError


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

# kvpress's compression ratio, as every policy budget below 1 counts it: the fraction of tokens removed
RATIO = _number(float, "must be in (0, 1): the fraction of the cache removed (0.75 keeps 25%)", lambda v: 0 < v < 1)
RATIO_HELP = "compression ratios as kvpress counts them, the fraction of the cache removed, in (0, 1)"


def renamed(parser, old: str, new: str) -> None:
    """`old` is refused by a usage error that names `new`, the option that replaced it."""

    class Refuse(argparse.Action):
        def __call__(self, parser_, namespace, values, option_string=None):
            parser_.error(f"{old} is gone: {new}")

    parser.add_argument(old, nargs="*", action=Refuse, help=argparse.SUPPRESS)


def check_output(path: str | Path, flag: str, *, directory: bool) -> Path:
    """`path`, where a command will write a directory (`directory`) or a file: refused before any compute
    unless it can be created there (or, existing, is of that kind and writable). Nothing is created."""
    path = Path(path)
    kind = "directory" if directory else "file"
    if path.exists() and path.is_dir() != directory:
        raise ConfigError(f"{flag}={path} is a {'file' if directory else 'directory'}; it must be a {kind}")
    if path.exists() and not directory:
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag}={path}: the file is not writable")
        return path
    ancestor = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    if not ancestor.is_dir():
        raise ConfigError(f"{flag}={path}: {ancestor} is a file, so no {kind} can be made under it")
    try:
        tempfile.TemporaryFile(dir=ancestor).close()  # the one test that holds for root and read-only mounts
    except OSError as e:
        raise ConfigError(f"{flag}={path}: cannot write under {ancestor} ({e.strerror})") from None
    return path


MODEL_HELP = "a run directory, a Hugging Face checkpoint directory, a .gguf file, or a shipped model (smollm2, gemma3)"
LONG_HELP = "go past the model's trained context (data.seq_len of a run; the GGUF file's context_length)"


def add_tensor(parser) -> None:
    """`--tensor N`: the model over N devices (`kvjax.sharding`)."""
    parser.add_argument(
        "--tensor",
        type=POSITIVE,
        default=1,
        help="split the model over this many devices: attention and KV heads and the MLP's hidden units "
        "(tensor parallelism), for a model or context one device cannot hold (default: 1)",
    )


def mesh_of(args):
    """The generation mesh `--tensor` asks for, or None for one device."""
    from kvjax.sharding import generation_mesh

    return generation_mesh(args.tensor) if args.tensor > 1 else None


def split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments containing '=' are overrides; the rest name configs."""
    return [a for a in items if "=" not in a], [a for a in items if "=" in a]

"""The `kvjax` command line: one module per command, above the library (which never imports it). Command
modules import the library inside `run`, so parsing (and `--help`) loads no JAX."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import traceback
import warnings
from pathlib import Path

from kvjax.commands import (
    compare,
    duo_train,
    evaluate,
    export,
    generate,
    launch,
    longbench,
    memory,
    ruler,
    serve,
    serve_bench,
    train,
    uptrain,
)
from kvjax.commands.args import Parser
from kvjax.errors import Note
from kvjax.interrupt import Interrupted

DESCRIPTION = "Train, decode, compress and compare KV-cache-efficient language models (see docs/cli.md)."
# In --help order.
COMMANDS = (
    memory,
    train,
    evaluate,
    generate,
    uptrain,
    export,
    duo_train,
    compare,
    ruler,
    longbench,
    serve,
    serve_bench,
    launch,
)
# Commands that run as several processes (JAX's multi-controller runtime; `kvjax launch`); the others refuse.
SEVERAL = ("train", "uptrain", "eval", "compare")


def build_parser() -> Parser:
    parser = Parser(prog="kvjax", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _show_notes() -> None:
    """kvjax's own warnings (`kvjax.config.Note`) as one `kvjax: note:` line each; others as Python shows them."""
    default = warnings.showwarning
    if getattr(default, "kvjax_notes", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Note):
            print(f"kvjax: note: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.kvjax_notes = True
    warnings.showwarning = show


def as_typed(argv: list[str]) -> str:
    """This command line as the user can type it again: `kvjax ...` when `kvjax` on PATH is this program,
    else the path it was started by (e.g. `.venv/bin/kvjax`)."""
    prog = sys.argv[0]
    if Path(prog).name != "kvjax":  # python -m kvjax.commands, or called from Python
        prog = "kvjax"
    elif (found := shutil.which("kvjax")) and Path(found).resolve() == Path(prog).resolve():
        prog = "kvjax"
    return shlex.join([prog, *argv])


def user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (bad configs, data, checkpoints, model files, divergence): one
    line, no traceback."""
    from kvjax.errors import ConfigError
    from kvjax.training.checkpoint import CheckpointError
    from kvjax.training.data import DataError
    from kvjax.training.distributed import DistributedError
    from kvjax.training.gguf_import import GGUFError
    from kvjax.training.trainer import TrainingError

    return ConfigError, CheckpointError, DataError, DistributedError, GGUFError, TrainingError


def _distributed() -> bool:
    """Whether this process joined a multi-process run (only possible once JAX is loaded)."""
    return "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized()


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
    except BaseException:
        if not _distributed():
            raise
        traceback.print_exc()
        code = 1
    if code and _distributed():
        # One process of several failed: leave at once. JAX's orderly exit would wait for the others at a
        # barrier they never reach; gone, this one is noticed by them (and by kvjax launch) instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(given: list[str] | None) -> int:
    argv = sys.argv[1:] if given is None else list(given)
    args = build_parser().parse_args(argv)
    _show_notes()
    errors = user_errors()
    try:
        if args.command != "launch":
            from kvjax.training.distributed import initialize

            if initialize():
                _join(args.command)
        args.run(args)
    except KeyboardInterrupt:
        # A second Ctrl-C, or one in a command that cannot stop cleanly: leave at once. Unwinding the
        # interpreter after jaxlib was interrupted mid-call has ended in a segmentation fault.
        print("kvjax: interrupted", file=sys.stderr, flush=True)
        if given is not None:  # called from Python: the caller's process is not ours to end
            return 130
        sys.stdout.flush()
        os._exit(130)
    except Interrupted as e:  # Ctrl-C at a clean point: what was kept, and how to go on
        print(f"kvjax: {e}; resume with: {as_typed(argv)}", file=sys.stderr)
        return 130
    except errors as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _out_of_memory(e):
            raise
        print(
            f"kvjax: error: out of memory ({str(e).splitlines()[0][:200]}); lower --batch, the sequence "
            "lengths or the cache capacity",
            file=sys.stderr,
        )
        return 2
    return 0


def _join(command: str) -> None:
    """This process is one of several: refuse commands that run on one host; only process 0 prints."""
    from kvjax.training.distributed import is_primary, refuse_several

    if command not in SEVERAL:
        refuse_several(f"kvjax {command}")
    if not is_primary():
        sys.stdout = open(os.devnull, "w")  # the others' logs would repeat process 0's; errors still show


def _out_of_memory(e: Exception) -> bool:
    return (
        "jax" in sys.modules
        and isinstance(e, sys.modules["jax"].errors.JaxRuntimeError)
        and ("RESOURCE_EXHAUSTED" in str(e))
    )

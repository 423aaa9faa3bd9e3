"""Ctrl-C at a clean point: long commands (training, RULER sweeps) stop where nothing is lost and say how
to go on, instead of unwinding from inside a jitted call (which jaxlib can answer with a crash at exit)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class Interrupted(Exception):
    """Ctrl-C stopped a command at a clean point; the message says what was kept. The command line prints
    it with the command that resumes, and exits 130."""


@contextlib.contextmanager
def deferred_interrupt(notice: str):
    """Within the block, a first Ctrl-C only sets the returned flag (the caller stops at a clean point) and
    prints `notice` at once on stderr; a second one raises KeyboardInterrupt. A no-op outside the main thread."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        flag.set()
        print(f"\n{notice}", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)

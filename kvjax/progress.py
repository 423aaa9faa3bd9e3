"""Progress bars: tqdm on a terminal; in a redirected log, a plain line at each tenth of the work, so a
log file holds a dozen lines rather than one carriage-return update per step."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm.auto import tqdm

LOG_LINES = 10  # lines a non-terminal log gets over the whole run


def progress(total: int, *, initial: int = 0, unit: str = "step", enabled: bool = True, file: TextIO | None = None):
    """A bar with tqdm's `update(n)`, `set_postfix(**kw)` and `close()`, over `total` units."""
    file = sys.stderr if file is None else file
    if not enabled or (hasattr(file, "isatty") and file.isatty()):
        return tqdm(total=total, initial=initial, unit=unit, leave=False, disable=not enabled, file=file)
    return LogProgress(total, initial=initial, unit=unit, file=file)


class LogProgress:
    """`progress` for a file that is not a terminal: one line per tenth of `total` (and at the end)."""

    def __init__(self, total: int, *, initial: int = 0, unit: str = "step", file: TextIO):
        self.total, self.n, self.unit, self.file = total, initial, unit, file
        self.start_n, self.start = initial, time.perf_counter()
        self.postfix = ""
        self._next = self._mark_after(initial)

    def _mark_after(self, n: int) -> int:
        """The first tenth of `total` above n."""
        tenth = max(1, -(-self.total // LOG_LINES))
        return (n // tenth + 1) * tenth

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self._next or self.n >= self.total:
            self._line()
            self._next = self._mark_after(self.n)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def _line(self) -> None:
        elapsed = time.perf_counter() - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        eta = f", eta {(self.total - self.n) / rate:.0f} s" if rate > 0 and self.n < self.total else ""
        extra = f", {self.postfix}" if self.postfix else ""
        print(
            f"{self.unit} {self.n}/{self.total} ({100 * self.n / self.total:.0f}%), {rate:.3g} {self.unit}/s"
            f"{eta}{extra}",
            file=self.file,
            flush=True,
        )

    def close(self) -> None:
        """Nothing to clear: every line written stays in the log."""

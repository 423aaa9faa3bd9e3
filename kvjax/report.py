"""Plain-text tables and human-readable byte counts for the CLI and the benchmark scripts."""

from __future__ import annotations

from collections.abc import Sequence


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units; exact integers below 1 KiB)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def plural(n: int, word: str) -> str:
    """'sample' for 1, 'samples' otherwise (the count itself is the caller's)."""
    return word if n == 1 else word + "s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-align the first column and right-align the rest, GitHub-markdown style."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])

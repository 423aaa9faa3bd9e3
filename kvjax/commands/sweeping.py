"""What `kvjax ruler` and `kvjax longbench` share: their policy flags, the plan of runs checked before the
weights load and resolved after, and a resumable sweep under a progress bar that Ctrl-C stops after the
sample in progress, then its tables."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from kvjax.commands.args import add_tensor

STOPPING = "kvjax: stopping after the sample in progress (its cells are kept); Ctrl-C again to stop at once"


def add_arguments(p, what: str) -> None:
    """--policy, --query-aware, --allow-long-context, --tensor, --separate-prefills and --no-progress."""
    p.add_argument(
        "--policy",
        action="append",
        help="a method run at every --ratios (snapkv, streaming) or a whole policy run as given (kivi:2); repeatable",
    )
    p.add_argument(
        "--query-aware",
        action=argparse.BooleanOptionalAction,
        help="compress the whole input, question included, so that scorers vote with the question's queries; "
        "the default (--no-query-aware, kvpress's leaderboard) compresses the context alone and then feeds "
        "the question and answer prefix through the compressed cache",
    )
    p.add_argument("--allow-long-context", action="store_true", help=f"run {what} past the model's trained context")
    add_tensor(p)
    p.add_argument(
        "--separate-prefills",
        action="store_true",
        help="each policy its own prefill instead of one shared observed prefill per sample (same answers; "
        "for timing what sharing saves)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def plan(args) -> list:
    """The runs of `--policy` at `--ratios`, every policy parsed (a bad one refused before any compute)."""
    from kvjax.compress import parse_policy
    from kvjax.training import sweeps

    runs = sweeps.runs(args.policy or [], args.ratios)
    for r in runs[1:]:
        parse_policy(r.policy)
    return runs


def resolved(runs: list, args, loaded) -> tuple[list, object]:
    """The runs with DuoAttention's shipped gates resolved for this model, checked against it, and the
    calibration tokens any of them needs."""
    from kvjax.commands.common import calibration_tokens, check_policies, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.training import sweeps

    texts = resolve_duo([r.policy for r in runs[1:]], args.model, loaded.config.model.name)
    check_policies(texts, loaded)
    runs = [runs[0], *(sweeps.Run(t, r.method, r.ratio) for t, r in zip(texts, runs[1:]))]
    return runs, calibration_tokens(loaded, [parse_policy(t) for t in texts], None)


def run(cells: int, args, sweep: Callable) -> tuple:
    """`sweep(on_cell=, stop=)` under a progress bar of `cells` cells, Ctrl-C setting `stop`: (the sweep,
    seconds)."""
    from kvjax.interrupt import deferred_interrupt
    from kvjax.progress import progress

    start = time.perf_counter()
    bar = progress(cells, unit="cell", enabled=not args.no_progress)
    try:
        with deferred_interrupt(STOPPING) as stop:
            swept = sweep(on_cell=lambda record: bar.update(1), stop=stop)
    finally:
        bar.close()
    return swept, time.perf_counter() - start


def report(swept, seconds: float, out: Path, heading: str, extra: dict[str, str] | None = None) -> None:
    """Write and print the sweep's tables and figures under `out` (and `extra` files: name -> text), then
    what was computed and read."""
    from kvjax.training import sweeps

    rows = sweeps.summarize(swept.records)
    written = sweeps.write_outputs(rows, out, heading)
    print(sweeps.markdown(rows, heading))
    for name, text in (extra or {}).items():
        (out / name).write_text(text)
        print(text)
        written.append(out / name)
    stale = f" ({swept.stale} of them replacing cells whose input has changed)" if swept.stale else ""
    print(
        f"{swept.computed} cells computed in {seconds:.1f} s{stale}, {len(swept.records) - swept.computed} read "
        f"from {out / 'results.jsonl'}; wrote " + ", ".join(str(p) for p in written)
    )

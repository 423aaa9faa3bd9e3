"""`kvjax longbench`: LongBench v1's 16 English tasks or LongBench v2 under compressed caches, each task
with its official prompt, generation length and metric, resumable."""

from __future__ import annotations

from pathlib import Path

from kvjax.commands import sweeping
from kvjax.commands.args import MODEL_HELP, POSITIVE, RATIO, RATIO_HELP, check_output, mesh_of
from kvjax.errors import ConfigError

MIN_LENGTH = 64  # the fewest prompt tokens --max-length may ask for
LARGEST_ANSWER = 512  # v1's longest generation (the summaries'): what the default max length leaves room for


def run(args) -> None:
    from kvjax.training import longbench
    from kvjax.training import longbench_eval as lb
    from kvjax.training.loading import check_context, load_model

    known = longbench.tasks(args.version)
    tasks = args.tasks or known
    if unknown := [t for t in tasks if t not in known]:
        raise ConfigError(f"--tasks {' '.join(unknown)}: LongBench v{args.version}'s tasks are {' '.join(known)}")
    data = Path(args.data)
    if args.max_length is not None and args.max_length < MIN_LENGTH:
        raise ConfigError(f"--max-length {args.max_length}: prompts need at least {MIN_LENGTH} tokens")
    samples = {t: longbench.load(data, t, args.samples) for t in tasks}  # every file checked before the weights
    runs = sweeping.plan(args)
    name = f"{Path(args.model).stem}-v{args.version}" + ("-query-aware" if args.query_aware else "")
    out = check_output(args.out or Path("runs/longbench") / name, "--out", directory=True)
    loaded = load_model(args.model, mesh=mesh_of(args))
    max_length = args.max_length or (loaded.context or 0) - LARGEST_ANSWER
    if max_length < MIN_LENGTH:
        raise ConfigError(
            f"--max-length: {loaded.config.model.name}'s trained context ({loaded.context or 'not stated'}) leaves "
            f"no default past the {LARGEST_ANSWER} tokens of the longest answer; give one (e.g. 3500)"
        )
    check_context(loaded, max_length + LARGEST_ANSWER, f"--max-length {max_length}", args.allow_long_context)
    runs, calibration = sweeping.resolved(runs, args, loaded)
    swept, seconds = sweeping.run(
        len(runs) * sum(map(len, samples.values())),
        args,
        lambda **progress: lb.sweep(
            loaded.model,
            loaded.tokenizer,
            bos=loaded.bos,
            samples=samples,
            max_length=max_length,
            runs_=runs,
            results=out / "results.jsonl",
            query_aware=bool(args.query_aware),
            calibration=calibration,
            share=not args.separate_prefills,
            **progress,
        ),
    )
    mode = "question-aware" if args.query_aware else "question-agnostic"
    heading = (
        f"LongBench v{args.version} on {loaded.config.model.name} ({mode}, prompts of at most {max_length} tokens)"
    )
    breakdown = lb.v2_table(swept.records)
    extra = {"results-v2.md": f"# {heading}: accuracy by difficulty and length\n\n{breakdown}\n"} if breakdown else {}
    sweeping.report(swept, seconds, out, heading, extra)


def register(sub) -> None:
    p = sub.add_parser("longbench", help="LongBench v1 (16 English tasks) or v2 under compressed caches")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--data",
        required=True,
        help="THUDM's data as published: v1's unpacked data.zip (narrativeqa.jsonl, ...) or v2's data.json",
    )
    p.add_argument("--version", type=int, choices=[1, 2], default=1, help="LongBench v1 or v2 (default: 1)")
    p.add_argument("--tasks", nargs="+", help="default: every task of the version (v1's 16 English ones)")
    p.add_argument("--samples", type=POSITIVE, help="the first N samples of each task (default: all)")
    p.add_argument(
        "--max-length",
        type=POSITIVE,
        help="prompts longer than this many tokens are cut in the middle of their context, as LongBench cuts "
        f"them (default: the model's trained context less {LARGEST_ANSWER})",
    )
    p.add_argument("--ratios", type=RATIO, nargs="+", default=[0.5, 0.75], help=f"{RATIO_HELP} (default: 0.5 0.75)")
    p.add_argument(
        "--out",
        help="output directory (default: runs/longbench/MODEL-vN, -query-aware added for that mode); its "
        "results.jsonl resumes a sweep and holds one sweep's cells only",
    )
    sweeping.add_arguments(p, "prompts")
    p.set_defaults(run=run)

"""`kvjax compare`: train every variant of an experiment and compare them, or every compression policy on one model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvjax.commands.args import (
    LONG_HELP,
    MODEL_HELP,
    POSITIVE,
    POSITIVE_FLOAT,
    RATIO,
    RATIO_HELP,
    check_output,
    renamed,
)
from kvjax.commands.common import CONTINUATION, DECODE_CONTEXT, PREFIX
from kvjax.errors import ConfigError


def run(args) -> None:
    from kvjax.training.compare import load_experiment, run_compare
    from kvjax.training.uptrain_compare import UptrainExperiment, run_uptrain_compare

    if args.policy:
        return _compare_policies(args)
    if args.out:
        check_output(args.out, "--out", directory=True)

    exp = load_experiment(args.experiment)
    if isinstance(exp, UptrainExperiment):
        if args.variants or args.seeds or args.lr_grid or args.decode_contexts or args.match_params:
            raise ConfigError(
                "--variants, --seeds, --lr-grid, --decode-contexts and --match-params apply to model "
                "comparisons; an uptraining experiment lists conversions and trains each once"
            )
        out = Path(args.out) if args.out else _compare_dir(args) / "uptrain"  # its runs apart from the variants'
        return run_uptrain_compare(exp, out, quick=args.quick, name=Path(args.experiment).stem)
    if args.variants:
        exp = dataclasses.replace(exp, variants=tuple(args.variants), pairs=())
    if args.seeds:
        exp = dataclasses.replace(exp, seeds=args.seeds)
    if args.lr_grid:
        exp = dataclasses.replace(exp, lr_grid=tuple(args.lr_grid))
    if args.decode_contexts:
        exp = dataclasses.replace(exp, decode_contexts=tuple(args.decode_contexts))
    if args.match_params:
        exp = dataclasses.replace(exp, match_params=True)
    name = Path(args.experiment).stem if args.experiment else "compare"
    # Every experiment shares runs/compare/{full,quick}/<variant> by default, so a variant trained with
    # the same config by another experiment is reused; tables and plots are named after the experiment.
    run_compare(exp, _compare_dir(args), quick=args.quick, name=name)


def _compare_dir(args) -> Path:
    """--out as given, else runs/compare/full (runs/compare/quick with --quick)."""
    return Path(args.out) if args.out else Path("runs/compare") / ("quick" if args.quick else "full")


def _compare_policies(args) -> None:
    """`kvjax compare --policy M ... --model MODEL`: every method at every ratio on one model."""
    from kvjax.commands.common import calibration_tokens, check_policies, fit_to_context, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.training import compression_eval as ce
    from kvjax.training.distributed import refuse_several
    from kvjax.training.loading import check_context, load_model

    refuse_several("kvjax compare --policy")

    parsed = [parse_policy(text) for text, _ in ce.table_runs(args.policy, args.ratios)[1:]]  # before compute
    out = check_output(_compare_dir(args), "--out", directory=True)
    model_ref = args.model or str(_compare_dir(args) / "gqa")
    if not args.model and not Path(model_ref).is_dir():
        raise ConfigError(
            f"--policy compresses one model: pass --model (a run directory, a .gguf file or smollm2), "
            f"or train the default {model_ref} first with `kvjax compare{' --quick' if args.quick else ''}`"
        )
    loaded = load_model(model_ref)
    fit_to_context(args, loaded)
    args.policy = resolve_duo(args.policy, model_ref, loaded.config.model.name)
    check_policies([text for text, _ in ce.table_runs(args.policy, args.ratios)[1:]], loaded)
    allow = args.allow_long_context
    check_context(loaded, args.prefix + args.continuation + 1, "--prefix + --continuation + 1", allow)
    check_context(loaded, args.context, f"--context={args.context}", allow)
    if args.passkey_length:
        check_context(loaded, args.passkey_length + ce.ANSWER_TOKENS, "--passkey-length + the answer", allow)
    model = loaded.model
    rows = ce.policy_table(
        model,
        loaded.tokenizer,
        args.policy,
        args.ratios,
        prefix=args.prefix,
        continuation=args.continuation,
        calibration=calibration_tokens(loaded, parsed, None),
        corpus=loaded.corpus,
        samples=args.samples,
        context=args.context,
        passkey_length=args.passkey_length,
        bos=loaded.bos,
    )
    title = (
        f"{model.config.name}: {args.samples} x ({args.prefix}-token prefix + {args.continuation} scored), "
        f"decode at {args.context} tokens"
    )
    print(ce.render_policy_table(rows, title))
    out = out / f"policies-{model.config.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(f"wrote {out}")


def register(sub) -> None:
    cmp = sub.add_parser("compare", help="train every variant of an experiment and compare them")
    cmp.add_argument(
        "--experiment",
        help="experiment YAML or shipped name, e.g. sharing, or uptrain (conversions "
        "of one source, uptrained and from scratch) (default: compare)",
    )
    cmp.add_argument("--quick", action="store_true", help="a short run, for a smoke test")
    cmp.add_argument("--variants", nargs="+", help="model configs to compare (default: the experiment's list)")
    cmp.add_argument(
        "--seeds", type=POSITIVE, help="trainings per variant, for 95%% intervals (default: the experiment's seeds, 1)"
    )
    cmp.add_argument(
        "--decode-contexts",
        type=POSITIVE,
        nargs="+",
        help="also decode speed at these contexts "
        "(e.g. 512 1024 2048 4096 8192), each model alone after training, plotted to NAME-decode.png",
    )
    cmp.add_argument(
        "--lr-grid",
        type=POSITIVE_FLOAT,
        nargs="+",
        help="learning rates tried per variant on a "
        "short budget, the best on a held-out selection split kept (default: the experiment's, none)",
    )
    cmp.add_argument(
        "--match-params",
        action="store_true",
        help="set each variant's model.ffn_dim so that its "
        "parameters equal the first variant's (default: the experiment's match_params, off)",
    )
    cmp.add_argument(
        "--out",
        help="directory for the runs, tables and plot, used as given "
        "(default: runs/compare/full, or runs/compare/quick with --quick)",
    )
    pol = cmp.add_argument_group("policy table (token-level compression of one model)")
    pol.add_argument(
        "--policy",
        action="append",
        help="a method run at every --ratios (snapkv, streaming, h2o, tova, keynorm, snapkv:obs_window=16) or a "
        "whole policy run as given (kivi:2, int:8, snapkv:0.5+kivi:4); repeatable",
    )
    renamed(pol, "--policies", "give --policy once per method or policy (--policy snapkv --policy tova)")
    pol.add_argument("--model", help=f"{MODEL_HELP} (default: the gqa run of this comparison)")
    pol.add_argument(
        "--ratios",
        type=RATIO,
        nargs="+",
        default=[0.75, 0.5, 0.25],
        help=f"{RATIO_HELP} (default: 0.75 0.5 0.25, i.e. 25%%, 50%% and 75%% kept)",
    )
    renamed(
        pol,
        "--budgets",
        "it counted the fraction kept; --ratios counts the fraction removed, as policies do (--budgets 0.25 is "
        "--ratios 0.75)",
    )
    pol.add_argument(
        "--prefix",
        type=POSITIVE,
        help=f"tokens compressed before the scored continuation (default: {PREFIX}, or what the "
        "model's context leaves)",
    )
    pol.add_argument(
        "--continuation",
        type=POSITIVE,
        help=f"tokens scored after the prefix through the compressed cache (default: {CONTINUATION}, "
        "at most a quarter of the model's context)",
    )
    pol.add_argument("--samples", type=POSITIVE, default=1, help="prefix/continuation pairs scored (default: 1)")
    pol.add_argument(
        "--context",
        type=POSITIVE,
        help=f"cache length for the decode speed (default: {DECODE_CONTEXT}, at most the model's context)",
    )
    pol.add_argument("--passkey-length", type=POSITIVE, help="also passkey accuracy at this prompt length")
    pol.add_argument("--allow-long-context", action="store_true", help=LONG_HELP)
    cmp.set_defaults(run=run)

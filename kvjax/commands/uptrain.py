"""`kvjax uptrain`: convert a pretrained model to another KV architecture and train it briefly."""

from __future__ import annotations

from pathlib import Path

from kvjax.commands.args import MODEL_HELP, check_output
from kvjax.errors import ConfigError


def run(args) -> None:
    from kvjax.report import format_table
    from kvjax.training.uptrain import uptrain

    if any("=" not in o for o in args.overrides):
        raise ConfigError(
            f"kvjax uptrain takes one source and one conversion, then key.sub=value overrides; got {args.overrides}"
        )
    run_dir = args.run_dir or f"runs/uptrain/{Path(args.source).stem}-{args.conversion.replace(':', '_')}"
    check_output(run_dir, "--run-dir", directory=True)
    record = uptrain(args.source, args.conversion, run_dir, args.overrides)
    after = record["after"]
    kv = record["kv_bytes_per_token"]
    rows = [
        [args.source, f"{kv['source']:,}", *_scores(record["source_eval"])],
        [f"{args.conversion}, converted", f"{kv['converted']:,}", *_scores(record["before"])],
        [f"{args.conversion}, after {after['step']} steps", f"{kv['converted']:,}", *_scores(after)],
    ]
    print(format_table(["model", "KV B/token", "val NLL (nats/token)", "bits/byte"], rows))
    print(
        f"{record['tokens']:,} training tokens in {record['train_seconds']:.0f} s; run: {run_dir} "
        f"(kvjax eval/generate {run_dir}; record in {run_dir}/uptrain.json)"
    )


def _scores(scores: dict) -> list[str]:
    return [f"{scores['eval_loss']:.4f}", f"{scores['eval_bpb']:.4f}"]


def register(sub) -> None:
    up = sub.add_parser("uptrain", help="convert a pretrained model to another KV architecture and train it briefly")
    up.add_argument("source", help=MODEL_HELP)
    up.add_argument(
        "conversion",
        help="mqa, gqa:kv_heads=K, cla2, cla:factor=F, mlkv:layers=M, swa:window=W, "
        "yoco-swa:window=W, mla:d_c=R,rope_dims=D, joined by + (options pool=mean|first, "
        "merge=mean|keep, select=norm|high); or a model config of the source's shape",
    )
    up.add_argument(
        "overrides",
        nargs="*",
        help="data.* and train.* overrides (an imported source starts from "
        "seq_len 256, 100 steps of batch 4 at lr 1e-4, 10 warm-up steps, one checkpoint kept; a "
        "train.steps=N alone scales the warm-up with it)",
    )
    up.add_argument(
        "--run-dir", help="where the run goes; an existing one resumes (default: runs/uptrain/<source>-<conversion>)"
    )
    up.set_defaults(run=run)

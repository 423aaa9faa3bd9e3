"""Decode tokens/s against context length for an experiment's variants, each measured alone.

`kvjax compare` draws this curve after training (experiment key `decode_contexts`); this script draws
it without training, since a decode step's time does not depend on the weights' values: every variant
is built at its initialization in the experiment's shape (its FFN width matched when the experiment
says `match_params`) and timed at each context, batch `decode_batch`, `decode_tokens` greedy tokens after
a prompt of KJV text prefilled in chunks (`kvjax.timing.decode_seconds`). Variants run one after
another in one process, so nothing else competes for the CPU.

    python scripts/bench_decode_curve.py [--experiment study] [--contexts 512 1024 2048 4096 8192]
        [--repeats 3] [--out runs/decode-curve]   # writes decode-curve.json and decode-curve.png there
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from flax import nnx

from kvjax import memory
from kvjax.architectures import Decoder
from kvjax.config import load_config
from kvjax.report import format_bytes, format_table
from kvjax.training.compare import decode_curve, environment, load_experiment, match_params, plot_decode_curves
from kvjax.training.trainer import prepare_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="study", help="an experiment name or file (default: study)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3, help="timed decodes per point (the median is kept)")
    parser.add_argument("--variants", nargs="+", help="a subset of the experiment's variants")
    parser.add_argument("--out", type=Path, help="folder for decode-curve.json and decode-curve.png")
    args = parser.parse_args()
    exp = load_experiment(args.experiment)
    exp = dataclasses.replace(exp, decode_contexts=tuple(args.contexts))  # checked against decode_tokens here
    unknown = set(args.variants or ()) - set(exp.variants)
    if unknown:
        raise SystemExit(f"--variants {sorted(unknown)} are not in the experiment's variants {list(exp.variants)}")
    configs = {v: load_config(v, exp.overrides) for v in exp.variants}
    if exp.match_params:
        configs = match_params(configs)
    configs = {v: c for v, c in configs.items() if not args.variants or v in args.variants}
    stream = prepare_corpus(next(iter(configs.values()))).val.reshape(-1)
    curves, rows = {}, []
    for variant, cfg in configs.items():
        model = Decoder(cfg.model, rngs=nnx.Rngs(0))
        curves[variant] = decode_curve(model, stream, exp, args.repeats)
        per_token = memory.cache_bytes(cfg.model, args.contexts[-1], 1) / args.contexts[-1]
        rows.append([variant, format_bytes(per_token), *(f"{curves[variant][c]:,.0f}" for c in args.contexts)])
        print(f"... {variant} done", file=sys.stderr, flush=True)
    print(
        f"decode tokens/s, batch {exp.decode_batch}, {exp.decode_tokens} new tokens, median of {args.repeats}; "
        f"experiment {args.experiment}"
    )
    print(format_table(["variant", f"cache/token at {args.contexts[-1]}", *map(str, args.contexts)], rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            "experiment": args.experiment,
            "batch": exp.decode_batch,
            "new_tokens": exp.decode_tokens,
            "repeats": args.repeats,
            "environment": environment(),
            "curves": curves,
        }
        (args.out / "decode-curve.json").write_text(json.dumps(record, indent=2))
        plot_decode_curves(curves, exp.decode_batch, args.out / "decode-curve.png")
        print(f"wrote {args.out}/decode-curve.json and decode-curve.png")


if __name__ == "__main__":
    main()

"""`kvjax duo-train`: learn DuoAttention's retrieval and streaming heads of a model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvjax.commands.args import (
    LONG_HELP,
    MODEL_HELP,
    NON_NEGATIVE,
    NON_NEGATIVE_FLOAT,
    POSITIVE,
    POSITIVE_FLOAT,
    check_output,
)


def run(args) -> None:
    from kvjax.duo import check_pattern_target, is_run, learned_pattern_path, save_pattern, streaming_heads
    from kvjax.training import compression_eval as ce
    from kvjax.training.duo import GateTraining, learn_gates
    from kvjax.training.loading import check_context, load_model

    cfg = GateTraining(
        steps=args.steps,
        length=args.length,
        keys=args.keys,
        words=args.words,
        sinks=args.sinks,
        recent=args.recent,
        lr=args.lr,
        reg=args.reg,
        seed=args.seed,
        local=args.local,
    )
    out = Path(args.out) if args.out else learned_pattern_path(args.model, None, args.local)
    if out is not None:
        check_pattern_target(out, args.overwrite)  # before loading the model
        check_output(out, "--out", directory=False)
    loaded = load_model(args.model)
    check_context(loaded, cfg.length, f"--length={cfg.length}", args.allow_long_context)
    if out is None:
        out = learned_pattern_path(args.model, loaded.config.model.name, args.local)
        check_pattern_target(out, args.overwrite)
        check_output(out, "--out", directory=False)
    filler = ce.corpus_tokens(loaded.tokenizer, args.corpus or loaded.corpus)
    result = learn_gates(loaded.model, loaded.tokenizer, filler, cfg)
    save_pattern(
        out,
        result["gates"],
        model=loaded.config.model.name,
        local=cfg.local,
        training=dataclasses.asdict(cfg),
        held_out_before=result["held_out_before"],
        held_out_after=result["held_out_after"],
        seconds=round(result["seconds"], 1),
        history=result["history"],
    )
    half = streaming_heads(result["gates"], 0.5)
    local = ":local" if cfg.local else ""
    use = "" if is_run(args.model) and not args.out else f"; use it with --policy duo:0.5{local}:pattern={out}"
    print(
        f"held-out objective {result['held_out_before']:.5f} -> {result['held_out_after']:.5f} "
        f"({cfg.steps} steps, {result['seconds']:.0f} s); wrote {out}{use}"
    )
    print("gates per layer (x = streaming at duo:0.5):")
    for layer, (g, s) in enumerate(zip(result["gates"], half)):
        print(f"  {layer:>3}: " + " ".join(f"{v:.2f}{'x' if h in s else ' '}" for h, v in enumerate(g)))


def register(sub) -> None:
    duo = sub.add_parser("duo-train", help="learn DuoAttention's retrieval/streaming heads of a model (policy duo:R)")
    duo.add_argument("model", help=MODEL_HELP)
    duo.add_argument("--steps", type=POSITIVE, default=200, help="optimizer steps, one sample each (default: 200)")
    duo.add_argument(
        "--length", type=POSITIVE, default=1024, help="tokens per synthetic passkey sample (default: 1024)"
    )
    duo.add_argument("--keys", type=POSITIVE, default=4, help="passkeys per sample (default: 4)")
    duo.add_argument("--words", type=POSITIVE, default=8, help="NATO words per passkey (default: 8)")
    duo.add_argument("--sinks", type=NON_NEGATIVE, default=64, help="streaming heads' sink tokens (default: 64)")
    duo.add_argument("--recent", type=POSITIVE, default=256, help="streaming heads' recent tokens (default: 256)")
    duo.add_argument("--lr", type=POSITIVE_FLOAT, default=0.02, help="gate learning rate (default: 0.02)")
    duo.add_argument("--reg", type=NON_NEGATIVE_FLOAT, default=0.05, help="L1 weight on the gates (default: 0.05)")
    duo.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    duo.add_argument(
        "--local",
        action="store_true",
        help="learn gates for the sliding-window layers too, for duo:R:local (the pattern serves duo:R as well)",
    )
    duo.add_argument("--corpus", help="haystack text (default: the run's own; kjv for GGUF models)")
    duo.add_argument(
        "--out",
        help="pattern file (default: RUN/duo_pattern.json for a run, which duo:R then reads; "
        "runs/duo/NAME.json (NAME.local.json with --local) for an imported model, read with "
        "duo:R:pattern=PATH; the shipped configs/duo/ patterns are never written)",
    )
    duo.add_argument("--overwrite", action="store_true", help="replace an existing pattern file")
    duo.add_argument("--allow-long-context", action="store_true", help=LONG_HELP)
    duo.set_defaults(run=run)

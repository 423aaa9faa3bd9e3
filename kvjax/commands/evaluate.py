"""`kvjax eval`: perplexity on a validation split, or quality under compressed caches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvjax.commands.args import LONG_HELP, MODEL_HELP, POSITIVE, UNIT, add_tensor, check_output, mesh_of
from kvjax.commands.common import CONTINUATION, LENGTHS, PREFIX
from kvjax.errors import ConfigError
from kvjax.report import plural


def run(args) -> None:
    from kvjax.progress import progress
    from kvjax.training.data import load_corpus, pack, split_documents
    from kvjax.training.distributed import is_primary, refuse_several
    from kvjax.training.loading import check_context, load_model
    from kvjax.training.trainer import evaluate_model

    task = args.task or ("continuation" if args.policy else "ppl")
    if task == "ppl" and args.policy:
        raise ConfigError("--policy applies to --task continuation, passkey or needle (ppl scores windows uncached)")
    if args.out:
        check_output(args.out, "--out", directory=True)
    if task != "ppl":
        refuse_several(f"kvjax eval --task {task}")
        return _eval_compressed(args, task)

    loaded = load_model(args.model, mesh=mesh_of(args))
    config = loaded.config
    data = dataclasses.replace(config.data, corpus=args.corpus or loaded.corpus)
    seq_len = args.seq_len or data.seq_len
    check_context(loaded, seq_len, f"--seq-len={seq_len}", args.allow_long_context)
    _, val_docs = split_documents(load_corpus(data.corpus), data.val_fraction)
    windows = pack(val_docs, loaded.tokenizer, seq_len + 1)[: args.windows]
    bar = progress(len(windows), unit="window", enabled=not args.no_progress and is_primary())
    scores = evaluate_model(loaded.model, windows, loaded.tokenizer, batch_size=args.batch, on_batch=bar.update)
    bar.close()
    text = (
        f"{config.model.name} on {data.corpus} validation ({len(windows)} {plural(len(windows), 'window')} of "
        f"{seq_len} tokens): {scores['eval_bpb']:.4f} bits/byte, perplexity {scores['eval_ppl']:.3f} "
        f"(loss {scores['eval_loss']:.4f} nats/token)"
    )
    print(text)
    if is_primary():
        _keep(
            args,
            text,
            dict(model=config.model.name, corpus=data.corpus, windows=len(windows), seq_len=seq_len, **scores),
        )


def _keep(args, text: str, results) -> None:
    """With --out: the printed result as results.md and the figures as results.json."""
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}")


def _eval_compressed(args, task: str) -> None:
    """`kvjax eval --task continuation|passkey|needle [--policy P ...]`: quality under compressed caches."""
    from kvjax.commands.common import calibration_tokens, check_policies, fit_to_context, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.progress import progress
    from kvjax.report import format_table
    from kvjax.training import compression_eval as ce
    from kvjax.training.loading import check_context, load_model

    parsed = [parse_policy(p) for p in args.policy or []]  # every policy is checked before compute
    loaded = load_model(args.model, mesh=mesh_of(args))
    policies = resolve_duo([str(p) for p in parsed], args.model, loaded.config.model.name)
    check_policies(policies, loaded)
    fit_to_context(args, loaded)
    model, tokenizer, corpus = loaded.model, loaded.tokenizer, args.corpus or loaded.corpus
    if task == "continuation":
        # One more token than scored: the first is predicted by the prefill itself, before compression.
        check_context(
            loaded, args.prefix + args.continuation + 1, "--prefix + --continuation + 1", args.allow_long_context
        )
    else:
        check_context(
            loaded,
            max(args.lengths) + ce.ANSWER_TOKENS,
            f"--lengths {max(args.lengths)} + the answer",
            args.allow_long_context,
        )
    calibration = calibration_tokens(loaded, parsed, args.corpus)
    if task == "continuation":
        stream = ce.corpus_tokens(tokenizer, corpus)
        prefixes, conts = ce.continuation_windows(
            stream, args.prefix, args.continuation, args.samples, tokenizer.bos_id if loaded.bos else None
        )
        bar = progress(len(prefixes) * (1 + len(policies)), unit="sample", enabled=not args.no_progress)
        rows = ce.continuation_eval(
            model, prefixes, conts, policies, batch=args.batch, calibration=calibration, on_batch=bar.update
        )
        bar.close()
        title = (
            f"{model.config.name} on {corpus}: {args.samples} x ({args.prefix}-token prefix, the next "
            f"{args.continuation} tokens scored through the compressed cache)"
        )
        table = format_table(
            ["policy", "NLL (nats/token)", "perplexity", "KL vs full", "cache B/token"],
            [
                [r.policy, f"{r.nll:.4f}", f"{r.ppl:.3f}", f"{r.kl:.4g}", f"{r.cache_bytes_per_token:,.0f}"]
                for r in rows
            ],
        )
        print(f"{title}\n{table}")
        return _keep(args, f"{title}\n\n{table}", [dataclasses.asdict(r) for r in rows])
    filler = ce.corpus_tokens(tokenizer, corpus)
    table, results = [], []
    cells = len(args.lengths) * len(args.depths)
    bar = progress(cells * (1 + len(policies)), unit="cell", enabled=not args.no_progress)
    for policy in [None, *policies]:
        acc = ce.retrieval_accuracy(
            model,
            tokenizer,
            task,
            args.lengths,
            args.depths,
            policy=policy,
            trials=args.trials,
            bos=loaded.bos,
            filler=filler,
            calibration=calibration,
            on_cell=bar.update,
        )
        table.append([policy or "full", *(f"{acc[(n, d)]:.2f}" for n in args.lengths for d in args.depths)])
        results += [dict(policy=policy or "full", length=n, depth=d, accuracy=a) for (n, d), a in acc.items()]
    bar.close()
    title = (
        f"{model.config.name}: {task} exact match, {args.trials} {plural(args.trials, 'trial')} per cell (length/depth)"
    )
    text = format_table(["policy", *(f"{n}/{d:g}" for n in args.lengths for d in args.depths)], table)
    print(f"{title}\n{text}")
    _keep(args, f"{title}\n\n{text}", results)


def register(sub) -> None:
    ev = sub.add_parser(
        "eval", help="perplexity on a validation split, or quality under compressed caches (--policy, --task)"
    )
    ev.add_argument("model", help=MODEL_HELP)
    ev.add_argument("--corpus", help="corpus spec (default: the run's own; kjv for GGUF models)")
    ev.add_argument("--seq-len", type=POSITIVE, help="ppl: window length (default: the run's data.seq_len)")
    ev.add_argument("--windows", type=POSITIVE, default=64, help="ppl: how many validation windows (default: 64)")
    ev.add_argument("--batch", type=POSITIVE, default=4, help="sequences per forward pass (default: 4)")
    ev.add_argument("--policy", action="append", help="a compression policy, e.g. snapkv:0.5 (repeatable)")
    ev.add_argument(
        "--task",
        choices=("ppl", "continuation", "passkey", "needle"),
        help="default: ppl, or continuation when --policy is given",
    )
    ev.add_argument(
        "--prefix",
        type=POSITIVE,
        help=f"continuation: prefix tokens compressed (default: {PREFIX}, or what the model's context "
        "leaves after the continuation)",
    )
    ev.add_argument(
        "--continuation",
        type=POSITIVE,
        help=f"continuation: tokens scored after the prefix, each predicted through the compressed "
        f"cache (default: {CONTINUATION}, at most a quarter of the model's context; one more token "
        "is read, the one the prefill predicts)",
    )
    ev.add_argument(
        "--samples", type=POSITIVE, default=1, help="continuation: how many prefix/continuation pairs (default: 1)"
    )
    ev.add_argument(
        "--lengths",
        type=POSITIVE,
        nargs="+",
        help=f"passkey/needle prompt lengths (default: {' '.join(map(str, LENGTHS))}, those the model's "
        "context holds, else its context less the answer)",
    )
    ev.add_argument(
        "--depths",
        type=UNIT,
        nargs="+",
        default=[0.1, 0.5, 0.9],
        help="passkey/needle depths in [0, 1] (default: 0.1 0.5 0.9)",
    )
    ev.add_argument("--trials", type=POSITIVE, default=4, help="passkey/needle prompts per cell (default: 4)")
    ev.add_argument("--allow-long-context", action="store_true", help=LONG_HELP)
    add_tensor(ev)
    ev.add_argument("--out", help="also keep the results here: results.md (the table) and results.json")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(run=run)

"""The `kvjax` command: the composition root that wires configs, models and reports together."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvjax import memory
from kvjax.config import ConfigError, load_config
from kvjax.plan import KV_KINDS, SHARABLE_KINDS
from kvjax.report import format_bytes, format_table


def _split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments containing '=' are overrides; the rest name configs."""
    return [a for a in items if "=" not in a], [a for a in items if "=" in a]


def _kv_shape(cfg) -> tuple[str, str]:
    """(KV heads, head dim) columns: an MLA layer caches one latent plus one shared RoPE key."""
    if "mla" in cfg.mixers:
        return "latent", f"{cfg.mla.kv_lora_rank}+{cfg.mla.qk_rope_head_dim}"
    if not set(SHARABLE_KINDS) & set(cfg.mixers):
        return "-", "-"
    return str(cfg.attention.n_kv_heads), str(cfg.attention.head_dim)


def memory_table(names: list[str], overrides: list[str], tokens: list[int], batch: int) -> str:
    """One row per config: shape, K/V bytes per token, whole-cache bytes, and the ratio to MHA."""
    headers = ["variant", "layers", "KV layers", "KV heads", "head dim", "dtype", "KV B/token", "cache B/token"]
    headers += ["state B/seq"]
    headers += [f"cache @{t // 1024}k" if t % 1024 == 0 else f"cache @{t}" for t in tokens]
    headers += [f"vs MHA @{tokens[-1] // 1024}k" if tokens[-1] % 1024 == 0 else "vs MHA"]
    rows = []
    for name in names:
        cfg = load_config(name, overrides).model
        total = [memory.cache_bytes(cfg, t, batch) for t in tokens]
        mha = memory.cache_bytes(memory.mha_reference(cfg), tokens[-1], batch)
        rows.append(
            [
                cfg.name,
                cfg.n_layers,
                sum(cfg.mixers[i] in KV_KINDS for i in set(cfg.kv_source)),
                *_kv_shape(cfg),
                cfg.dtype,
                memory.kv_bytes_per_token(cfg),
                memory.cache_bytes_per_token(cfg),
                memory.state_bytes_per_sequence(cfg),
                *(format_bytes(b) for b in total),
                f"{total[-1] / mha:.4f}",
            ]
        )
    return format_table(headers, rows)


def _cmd_memory(args) -> None:
    names, overrides = _split_overrides(args.configs)
    if not names:
        raise ConfigError("kvjax memory needs at least one config (a YAML path or a shipped name)")
    if args.batch <= 0 or any(t <= 0 for t in args.tokens):
        raise ConfigError(f"--batch={args.batch} and --tokens={args.tokens} must be > 0")
    print(memory_table(names, overrides, sorted(args.tokens), args.batch))
    print(
        f"\nKV layers: layers that store K/V (or an MLA latent). KV B/token: what each token adds to the caches"
        f" that grow without bound (the papers' figure); cache B/token adds each slot's int32 position."
        f" state B/seq: what does not grow: full sliding-window rings, recurrent states, length counters."
        f" Cache columns: all arrays of all layers for batch {args.batch}; the ratio compares with MHA of the"
        f" same shape."
    )


def _cmd_train(args) -> None:
    from training.sharding import maybe_initialize_distributed
    from training.trainer import Trainer

    names, overrides = _split_overrides(args.config)
    if len(names) != 1:
        raise ConfigError(f"kvjax train needs exactly one config, got {names}")
    maybe_initialize_distributed()
    config = load_config(names[0], overrides)
    run_dir = Path(args.run_dir or f"runs/{config.model.name}")
    trainer = Trainer(config, run_dir)
    print(f"training {config.model.name} in {run_dir} from step {trainer.step} of {config.train.steps}")
    trainer.run(log=lambda row: print(json.dumps(row), flush=True) if "eval_loss" in row else None)
    print(json.dumps({"step": trainer.step, **trainer.evaluate()}))


def _is_gguf(model_ref: str) -> bool:
    from training.gguf_import import SHIPPED

    return model_ref in SHIPPED or model_ref.endswith(".gguf")


def _load_any(model_ref: str):
    """A trained run directory, a .gguf file, or a shipped GGUF model name -> (config, model, tokenizer)."""
    from training.gguf_import import load_gguf_model, load_gguf_tokenizer
    from training.trainer import load_trained

    if _is_gguf(model_ref):
        config, model = load_gguf_model(model_ref)
        return config, model, load_gguf_tokenizer(model_ref)
    return load_trained(model_ref)


def _cmd_eval(args) -> None:
    task = args.task or ("continuation" if args.policy else "ppl")
    if task != "ppl":
        return _eval_compressed(args, task)
    if args.policy:
        raise ConfigError("--policy applies to --task continuation, passkey or needle (ppl scores windows uncached)")

    from training.data import load_corpus, pack, split_documents
    from training.trainer import evaluate_model

    config, model, tokenizer = _load_any(args.model)
    data = config.data if args.corpus is None else dataclasses.replace(config.data, corpus=args.corpus)
    seq_len = args.seq_len or data.seq_len
    _, val_docs = split_documents(load_corpus(data.corpus), data.val_fraction)
    windows = pack(val_docs, tokenizer, seq_len + 1)[: args.windows]
    scores = evaluate_model(model, windows, tokenizer, batch_size=args.batch)
    print(
        f"{config.model.name} on {data.corpus} validation ({len(windows)} windows of {seq_len} tokens): "
        f"{scores['eval_bpb']:.4f} bits/byte, perplexity {scores['eval_ppl']:.3f} "
        f"(loss {scores['eval_loss']:.4f} nats/token)"
    )


def _eval_compressed(args, task: str) -> None:
    """`kvjax eval --task continuation|passkey|needle [--policy P ...]`: quality under compressed caches."""
    from kvjax.compress import parse_policy
    from kvjax.report import format_table
    from training import compression_eval as ce

    parsed = [parse_policy(p) for p in args.policy or []]  # every policy is checked before compute
    policies = [str(p) for p in parsed]
    _, model, tokenizer = _load_any(args.model)
    bos = not _is_gguf(args.model)
    palu = any(s.method == "palu" for p in parsed for s in p.stages)
    calibration = ce.calibration_tokens(tokenizer, args.corpus or "kjv") if palu else None
    if task == "continuation":
        stream = ce.corpus_tokens(tokenizer, args.corpus or "kjv")
        prefixes, conts = ce.continuation_windows(
            stream, args.prefix, args.continuation, args.samples, tokenizer.bos_id if bos else None
        )
        rows = ce.continuation_eval(model, prefixes, conts, policies, batch=args.batch, calibration=calibration)
        print(f"{model.config.name}: {args.samples} x ({args.prefix}-token prefix, next {args.continuation} tokens)")
        print(format_table(
            ["policy", "NLL (nats/token)", "perplexity", "KL vs full", "cache B/token"],
            [[r.policy, f"{r.nll:.4f}", f"{r.ppl:.3f}", f"{r.kl:.4g}", f"{r.cache_bytes_per_token:,.0f}"] for r in rows],
        ))
        return
    filler = ce.corpus_tokens(tokenizer, args.corpus or "kjv")
    table = []
    for policy in [None, *policies]:
        acc = ce.retrieval_accuracy(model, tokenizer, task, args.lengths, args.depths, policy=policy,
                                    trials=args.trials, bos=bos, filler=filler, calibration=calibration)
        table.append([policy or "full", *(f"{acc[(n, d)]:.2f}" for n in args.lengths for d in args.depths)])
    print(f"{model.config.name}: {task} exact match, {args.trials} trials per cell (length/depth)")
    print(format_table(["policy", *(f"{n}/{d:g}" for n in args.lengths for d in args.depths)], table))


def _cmd_generate(args) -> None:
    from kvjax.compress import parse_policy
    from kvjax.config import DecodingConfig
    from kvjax.generate import generate

    policy = parse_policy(args.policy) if args.policy else None
    _, model, tokenizer = _load_any(args.model)
    # Runs trained here saw BOS at every document start; imported models get no special token unless asked.
    bos = args.bos if args.bos is not None else not _is_gguf(args.model)
    decoding = DecodingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
    )
    prompt = [tokenizer.bos_id, *tokenizer.encode(args.prompt)] if bos else tokenizer.encode(args.prompt)
    out = generate(model, [prompt], decoding, policy=policy)
    print(args.prompt + tokenizer.decode(out.tokens[0, : out.lengths[0]]))


def _cmd_compare(args) -> None:
    if args.policies:
        return _compare_policies(args)
    from training.compare import load_experiment, run_compare

    exp = load_experiment(args.experiment)
    if args.variants:
        exp = dataclasses.replace(exp, variants=tuple(args.variants))
    name = Path(args.experiment).stem if args.experiment else "compare"
    # Every experiment shares runs/compare/{full,quick}/<variant>, so a variant trained with the same
    # config by another experiment is reused; tables and plots are named after the experiment.
    run_compare(exp, Path(args.out) / ("quick" if args.quick else "full"), quick=args.quick, name=name)


def _compare_policies(args) -> None:
    """`kvjax compare --policies M ... --model MODEL`: every method at every budget on one model."""

    from kvjax.compress import parse_policy
    from training import compression_eval as ce

    for text, _ in ce.table_runs(args.policies, args.budgets)[1:]:  # checked before any compute
        parse_policy(text)
    model_ref = args.model or str(Path(args.out) / ("quick" if args.quick else "full") / "gqa")
    _, model, tokenizer = _load_any(model_ref)
    palu = any(m.partition(":")[0] == "palu" for m in args.policies)
    rows = ce.policy_table(
        model, tokenizer, args.policies, args.budgets, prefix=args.prefix, continuation=args.continuation,
        calibration=ce.calibration_tokens(tokenizer) if palu else None,
        samples=args.samples, context=args.context, passkey_length=args.passkey_length, bos=not _is_gguf(model_ref),
    )
    title = (f"{model.config.name}: {args.samples} x ({args.prefix}-token prefix + {args.continuation} scored), "
             f"decode at {args.context} tokens")
    print(ce.render_policy_table(rows, title))
    out = Path(args.out) / f"policies-{model.config.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(f"wrote {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="analytic KV-cache memory of model configs")
    mem.add_argument("configs", nargs="+", help="YAML paths or shipped names, then key.sub=value overrides")
    mem.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], help="sequence lengths")
    mem.add_argument("--batch", type=int, default=1)
    mem.set_defaults(run=_cmd_memory)

    train = sub.add_parser("train", help="train (or resume) a model on a corpus")
    train.add_argument("config", nargs="+", help="a YAML path or shipped name, then key.sub=value overrides")
    train.add_argument("--run-dir", help="where checkpoints and metrics go (default runs/<model name>)")
    train.set_defaults(run=_cmd_train)

    model_help = "a run directory, a .gguf file, or a shipped model (smollm2)"
    ev = sub.add_parser(
        "eval", help="perplexity on a validation split, or quality under compressed caches (--policy, --task)"
    )
    ev.add_argument("model", help=model_help)
    ev.add_argument("--corpus", help="corpus spec (default: the run's own; kjv for GGUF models)")
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's data.seq_len)")
    ev.add_argument("--windows", type=int, default=64, help="how many validation windows")
    ev.add_argument("--batch", type=int, default=4)
    ev.add_argument("--policy", action="append", help="a compression policy, e.g. snapkv:0.5 (repeatable)")
    ev.add_argument("--task", choices=("ppl", "continuation", "passkey", "needle"),
                    help="default: ppl, or continuation when --policy is given")
    ev.add_argument("--prefix", type=int, default=1536, help="continuation: prefix tokens compressed")
    ev.add_argument("--continuation", type=int, default=255, help="continuation: tokens scored after it")
    ev.add_argument("--samples", type=int, default=1, help="continuation: how many prefix/continuation pairs")
    ev.add_argument("--lengths", type=int, nargs="+", default=[512, 1024], help="passkey/needle prompt lengths")
    ev.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="needle depths in [0, 1]")
    ev.add_argument("--trials", type=int, default=4, help="passkey/needle prompts per cell")
    ev.set_defaults(run=_cmd_eval)

    gen = sub.add_parser("generate", help="continue a text prompt")
    gen.add_argument("model", help=model_help)
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--bos", action=argparse.BooleanOptionalAction, help="start the prompt with BOS (default: for runs trained here)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--policy", help="compress the cache, e.g. snapkv:0.5 or streaming:256:every=1")
    gen.set_defaults(run=_cmd_generate)

    cmp = sub.add_parser("compare", help="train every variant of an experiment and compare them")
    cmp.add_argument("--experiment", help="experiment YAML or shipped name, e.g. sharing (default: compare)")
    cmp.add_argument("--quick", action="store_true", help="a short run, for a smoke test")
    cmp.add_argument("--variants", nargs="+", help="model configs to compare (default: the experiment's list)")
    cmp.add_argument("--out", default="runs/compare", help="output directory")
    pol = cmp.add_argument_group("policy table (token-level compression of one model)")
    pol.add_argument("--policies", nargs="+", help="methods run at every budget (snapkv streaming h2o tova keynorm, "
                     "snapkv:obs_window=16) and whole policies run as given (kivi:2 int:8 snapkv:0.5+kivi:4)")
    pol.add_argument("--model", help=f"{model_help} (default: the gqa run of this comparison)")
    pol.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="fractions of the prefix kept")
    pol.add_argument("--prefix", type=int, default=1536, help="tokens compressed before the scored continuation")
    pol.add_argument("--continuation", type=int, default=255)
    pol.add_argument("--samples", type=int, default=1)
    pol.add_argument("--context", type=int, default=2048, help="cache length for the decode speed")
    pol.add_argument("--passkey-length", type=int, help="also passkey accuracy at this prompt length")
    cmp.set_defaults(run=_cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ConfigError, *_user_errors()) as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    return 0


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (bad data, checkpoints, divergence): printed without a traceback."""
    from training.checkpoint import CheckpointError
    from training.data import DataError
    from training.gguf_import import GGUFError
    from training.trainer import TrainingError

    return (CheckpointError, DataError, GGUFError, TrainingError)


if __name__ == "__main__":
    sys.exit(main())

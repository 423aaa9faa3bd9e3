"""The `kvjax` command: the composition root that wires configs, models and reports together."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import warnings
from pathlib import Path

from kvjax import memory
from kvjax.config import ConfigError, Note, load_config
from kvjax.plan import KV_KINDS, SHARABLE_KINDS
from kvjax.report import format_bytes, format_table


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as kvjax's other errors are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type, rule: str, ok):
    """An argparse type: a number of `kind` for which ok(value) holds, else '<value> <rule>'."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} {rule}")
        return value

    return parse


POSITIVE = _number(int, "must be >= 1", lambda v: v >= 1)
NON_NEGATIVE = _number(int, "must be >= 0", lambda v: v >= 0)
NON_NEGATIVE_FLOAT = _number(float, "must be >= 0", lambda v: v >= 0)
POSITIVE_FLOAT = _number(float, "must be > 0", lambda v: v > 0)
UNIT = _number(float, "must be in [0, 1]", lambda v: 0 <= v <= 1)
OPEN_UNIT = _number(float, "must be in (0, 1]", lambda v: 0 < v <= 1)


def _split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments containing '=' are overrides; the rest name configs."""
    return [a for a in items if "=" not in a], [a for a in items if "=" in a]


def _kv_shape(cfg) -> tuple[str, str]:
    """(KV heads, head dim) columns: an MLA layer caches one latent plus one shared RoPE key."""
    if "mla" in cfg.mixers:
        rope = cfg.mla.qk_rope_head_dim if cfg.mla.rope_heads == 1 else f"{cfg.mla.rope_heads}x{cfg.mla.qk_rope_head_dim}"
        return "latent", f"{cfg.mla.kv_lora_rank}+{rope}"
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
    print(memory_table(names, overrides, sorted(args.tokens), args.batch))
    print(
        f"\nKV layers: layers that store K/V (or an MLA latent). KV B/token: what each token adds to the caches"
        f" that grow without bound (the papers' figure); cache B/token adds each slot's int32 position."
        f" state B/seq: what does not grow: full sliding-window rings, recurrent states, length counters."
        f" Cache columns: all arrays of all layers for batch {args.batch}; the ratio compares with MHA of the"
        f" same shape."
    )


def _train_target(names: list[str], overrides: list[str], run_dir: str | None):
    """(config, run directory) of `kvjax train`: a model config (+ --run-dir), or a run directory,
    resumed with the config it was started with (its config.yaml, or for a run made before those were
    written, its latest checkpoint's record), overrides applied on top."""
    from kvjax.config import Config, apply_overrides, from_dict
    from training.checkpoint import Checkpointer
    from training.trainer import RUN_CONFIG

    if len(names) != 1:
        raise ConfigError(f"kvjax train needs exactly one config or run directory, got {names}")
    given = Path(names[0])
    if not (given / RUN_CONFIG).is_file() and not (given / "checkpoints").is_dir():
        config = load_config(names[0], overrides)
        return config, Path(run_dir or f"runs/{config.model.name}")
    if run_dir is not None and Path(run_dir).resolve() != given.resolve():
        raise ConfigError(f"--run-dir={run_dir} differs from the run directory {names[0]} being resumed")
    if (given / RUN_CONFIG).is_file():
        return load_config(given / RUN_CONFIG, overrides), given
    _, record = Checkpointer(given / "checkpoints", create=False).read_record()
    return from_dict(Config, apply_overrides(record["config"], overrides)), given


def _cmd_train(args) -> None:
    from training.sharding import maybe_initialize_distributed
    from training.trainer import Trainer

    names, overrides = _split_overrides(args.config)
    config, run_dir = _train_target(names, overrides, args.run_dir)
    maybe_initialize_distributed()
    trainer = Trainer(config, run_dir)
    steps = config.train.steps
    if trainer.extended_from is not None:
        print(f"train.steps {trainer.extended_from} -> {steps}: the learning-rate schedule now decays over {steps} steps")
    done = " (finished: nothing to train)" if trainer.step >= steps else ""
    print(f"training {config.model.name} in {run_dir} from step {trainer.step} of {steps}{done}")
    history = trainer.run(log=lambda row: print(json.dumps(row), flush=True) if "eval_loss" in row else None)
    print(json.dumps({"step": trainer.step, **trainer.final_scores(history)}))


def _cmd_uptrain(args) -> None:
    from training.uptrain import uptrain

    if any("=" not in o for o in args.overrides):
        raise ConfigError(f"kvjax uptrain takes one source and one conversion, then key.sub=value overrides; "
                          f"got {args.overrides}")
    run_dir = args.run_dir or f"runs/uptrain/{Path(args.source).stem}-{args.conversion.replace(':', '_')}"
    record = uptrain(args.source, args.conversion, run_dir, args.overrides)
    after = record["after"]
    kv = record["kv_bytes_per_token"]
    rows = [[args.source, f"{kv['source']:,}", *_scores(record["source_eval"])],
            [f"{args.conversion}, converted", f"{kv['converted']:,}", *_scores(record["before"])],
            [f"{args.conversion}, after {after['step']} steps", f"{kv['converted']:,}", *_scores(after)]]
    print(format_table(["model", "KV B/token", "val NLL (nats/token)", "bits/byte"], rows))
    print(f"{record['tokens']:,} training tokens in {record['train_seconds']:.0f} s; run: {run_dir} "
          f"(kvjax eval/generate {run_dir}; record in {run_dir}/uptrain.json)")


def _cmd_duo_train(args) -> None:
    from kvjax.duo import check_pattern_target, is_run, learned_pattern_path, save_pattern, streaming_heads
    from training import compression_eval as ce
    from training.duo import GateTraining, learn_gates
    from training.loading import check_context, load_model

    cfg = GateTraining(steps=args.steps, length=args.length, keys=args.keys, words=args.words, sinks=args.sinks,
                       recent=args.recent, lr=args.lr, reg=args.reg, seed=args.seed)
    out = Path(args.out) if args.out else learned_pattern_path(args.model, None)
    if out is not None:
        check_pattern_target(out, args.overwrite)  # before loading the model
    loaded = load_model(args.model)
    check_context(loaded, cfg.length, f"--length={cfg.length}", args.allow_long_context)
    if out is None:
        out = learned_pattern_path(args.model, loaded.config.model.name)
        check_pattern_target(out, args.overwrite)
    filler = ce.corpus_tokens(loaded.tokenizer, args.corpus or loaded.corpus)
    result = learn_gates(loaded.model, loaded.tokenizer, filler, cfg)
    save_pattern(out, result["gates"], model=loaded.config.model.name, training=dataclasses.asdict(cfg),
                 held_out_before=result["held_out_before"], held_out_after=result["held_out_after"],
                 seconds=round(result["seconds"], 1), history=result["history"])
    half = streaming_heads(result["gates"], 0.5)
    use = "" if is_run(args.model) and not args.out else f"; use it with --policy duo:0.5:pattern={out}"
    print(f"held-out objective {result['held_out_before']:.5f} -> {result['held_out_after']:.5f} "
          f"({cfg.steps} steps, {result['seconds']:.0f} s); wrote {out}{use}")
    print("gates per layer (x = streaming at duo:0.5):")
    for layer, (g, s) in enumerate(zip(result["gates"], half)):
        print(f"  {layer:>3}: " + " ".join(f"{v:.2f}{'x' if h in s else ' '}" for h, v in enumerate(g)))


def _scores(scores: dict) -> list[str]:
    return [f"{scores['eval_loss']:.4f}", f"{scores['eval_bpb']:.4f}"]


def _calibration(loaded, policies, corpus: str | None):
    """Palu's calibration tokens (the corpus's training split) when a policy needs them, else None."""
    from training import compression_eval as ce

    if not any(s.method == "palu" for p in policies for s in p.stages):
        return None
    return ce.calibration_tokens(loaded.tokenizer, corpus or loaded.corpus)


def _resolve_duo(texts: list[str], model_ref: str, loaded) -> list[str]:
    """Policy texts (or `--policies` methods) whose `duo` stages read the model's learned pattern
    (`kvjax.duo.default_pattern`) unless they name one."""
    from kvjax.duo import default_pattern, with_pattern

    path = default_pattern(model_ref, loaded.config.model.name)
    shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
    return [with_pattern(text, shown) for text in texts]


def _check_duo(texts: list[str], loaded) -> None:
    """Each `duo` stage's pattern exists and fits the model, checked before any compute."""
    from kvjax.compress import parse_policy
    from kvjax.duo import duo_heads

    for text in texts:
        for stage in parse_policy(text).stages:
            if stage.method == "duo":
                duo_heads(stage, loaded.config.model)


def _cmd_eval(args) -> None:
    from training.loading import check_context, load_model

    task = args.task or ("continuation" if args.policy else "ppl")
    if task == "ppl" and args.policy:
        raise ConfigError("--policy applies to --task continuation, passkey or needle (ppl scores windows uncached)")
    if task != "ppl":
        return _eval_compressed(args, task)

    from training.data import load_corpus, pack, split_documents
    from training.trainer import evaluate_model

    loaded = load_model(args.model)
    config = loaded.config
    data = dataclasses.replace(config.data, corpus=args.corpus or loaded.corpus)
    seq_len = args.seq_len or data.seq_len
    check_context(loaded, seq_len, f"--seq-len={seq_len}", args.allow_long_context)
    _, val_docs = split_documents(load_corpus(data.corpus), data.val_fraction)
    windows = pack(val_docs, loaded.tokenizer, seq_len + 1)[: args.windows]
    scores = evaluate_model(loaded.model, windows, loaded.tokenizer, batch_size=args.batch)
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
    from training.loading import check_context, load_model

    parsed = [parse_policy(p) for p in args.policy or []]  # every policy is checked before compute
    loaded = load_model(args.model)
    policies = _resolve_duo([str(p) for p in parsed], args.model, loaded)
    _check_duo(policies, loaded)
    _fit_to_context(args, loaded)
    model, tokenizer, corpus = loaded.model, loaded.tokenizer, args.corpus or loaded.corpus
    if task == "continuation":
        # One more token than scored: the first is predicted by the prefill itself, before compression.
        check_context(loaded, args.prefix + args.continuation + 1, "--prefix + --continuation + 1",
                      args.allow_long_context)
    else:
        check_context(loaded, max(args.lengths) + ce.ANSWER_TOKENS, f"--lengths {max(args.lengths)} + the answer",
                      args.allow_long_context)
    calibration = _calibration(loaded, parsed, args.corpus)
    if task == "continuation":
        stream = ce.corpus_tokens(tokenizer, corpus)
        prefixes, conts = ce.continuation_windows(
            stream, args.prefix, args.continuation, args.samples, tokenizer.bos_id if loaded.bos else None
        )
        rows = ce.continuation_eval(model, prefixes, conts, policies, batch=args.batch, calibration=calibration)
        print(f"{model.config.name} on {corpus}: {args.samples} x ({args.prefix}-token prefix, the next "
              f"{args.continuation} tokens scored through the compressed cache)")
        print(format_table(
            ["policy", "NLL (nats/token)", "perplexity", "KL vs full", "cache B/token"],
            [[r.policy, f"{r.nll:.4f}", f"{r.ppl:.3f}", f"{r.kl:.4g}", f"{r.cache_bytes_per_token:,.0f}"] for r in rows],
        ))
        return
    filler = ce.corpus_tokens(tokenizer, corpus)
    table = []
    for policy in [None, *policies]:
        acc = ce.retrieval_accuracy(model, tokenizer, task, args.lengths, args.depths, policy=policy,
                                    trials=args.trials, bos=loaded.bos, filler=filler, calibration=calibration)
        table.append([policy or "full", *(f"{acc[(n, d)]:.2f}" for n in args.lengths for d in args.depths)])
    print(f"{model.config.name}: {task} exact match, {args.trials} trials per cell (length/depth)")
    print(format_table(["policy", *(f"{n}/{d:g}" for n in args.lengths for d in args.depths)], table))


PREFIX, CONTINUATION, DECODE_CONTEXT, LENGTHS = 1536, 255, 2048, (512, 1024)  # defaults, fitted to the model


def _fit_to_context(args, loaded) -> None:
    """Defaults for the lengths the user left unset that fit the model's trained context: a quarter of it
    at most for the continuation, the rest (less the token the prefill predicts) for the prefix, the
    context itself at most for decode timings and passkey prompts. Given values are checked as given."""
    from training.compression_eval import ANSWER_TOKENS

    ctx = loaded.context or 1 << 30
    if getattr(args, "continuation", 0) is None:
        args.continuation = min(CONTINUATION, max(1, ctx // 4))
    if getattr(args, "prefix", 0) is None:
        args.prefix = min(PREFIX, max(1, ctx - args.continuation - 1))
    if getattr(args, "context", 0) is None:
        args.context = min(DECODE_CONTEXT, ctx)
    if getattr(args, "lengths", 0) is None:
        args.lengths = [n for n in LENGTHS if n + ANSWER_TOKENS <= ctx] or [max(1, ctx - ANSWER_TOKENS)]


def _cmd_generate(args) -> None:
    from kvjax.compress import parse_policy
    from kvjax.config import DecodingConfig
    from kvjax.generate import generate
    from training.loading import check_context, load_model

    policy = parse_policy(args.policy) if args.policy else None
    loaded = load_model(args.model)
    if policy is not None:
        text = _resolve_duo([str(policy)], args.model, loaded)
        _check_duo(text, loaded)
        policy = parse_policy(text[0])
    tokenizer = loaded.tokenizer
    # Runs trained here saw BOS at every document start; imported models get no special token unless asked.
    bos = args.bos if args.bos is not None else loaded.bos
    prompt = [tokenizer.bos_id, *tokenizer.encode(args.prompt)] if bos else tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt='' gives no token; write some text, or pass --bos to start from BOS alone")
    check_context(loaded, len(prompt) + args.max_new_tokens, f"a prompt of {len(prompt)} tokens + "
                  f"--max-new-tokens={args.max_new_tokens}", args.allow_long_context)
    decoding = DecodingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
    )
    calibration = _calibration(loaded, [policy] if policy else [], args.corpus)
    out = generate(loaded.model, [prompt], decoding, policy=policy, calibration=calibration)
    print(args.prompt + completion(tokenizer, out.tokens[0, : out.lengths[0]]))


def completion(tokenizer, tokens) -> str:
    """The generated text: the end token a generation stopped at (a chat model's `<|im_end|>`) is not text."""
    tokens = list(tokens)
    if tokens and tokens[-1] == tokenizer.eos_id:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def _cmd_compare(args) -> None:
    if args.policies:
        return _compare_policies(args)
    from training.compare import load_experiment, run_compare
    from training.uptrain_compare import UptrainExperiment, run_uptrain_compare

    exp = load_experiment(args.experiment)
    if isinstance(exp, UptrainExperiment):
        if args.variants or args.seeds or args.lr_grid or args.decode_contexts or args.match_params:
            raise ConfigError("--variants, --seeds, --lr-grid, --decode-contexts and --match-params apply to model "
                              "comparisons; an uptraining experiment lists conversions and trains each once")
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
    """`kvjax compare --policies M ... --model MODEL`: every method at every budget on one model."""

    from kvjax.compress import parse_policy
    from training import compression_eval as ce
    from training.loading import check_context, load_model

    parsed = [parse_policy(text) for text, _ in ce.table_runs(args.policies, args.budgets)[1:]]  # before compute
    model_ref = args.model or str(_compare_dir(args) / "gqa")
    if not args.model and not Path(model_ref).is_dir():
        raise ConfigError(f"--policies compresses one model: pass --model (a run directory, a .gguf file or smollm2), "
                          f"or train the default {model_ref} first with `kvjax compare{' --quick' if args.quick else ''}`")
    loaded = load_model(model_ref)
    _fit_to_context(args, loaded)
    args.policies = _resolve_duo(args.policies, model_ref, loaded)
    _check_duo([text for text, _ in ce.table_runs(args.policies, args.budgets)[1:]], loaded)
    allow = args.allow_long_context
    check_context(loaded, args.prefix + args.continuation + 1, "--prefix + --continuation + 1", allow)
    check_context(loaded, args.context, f"--context={args.context}", allow)
    if args.passkey_length:
        check_context(loaded, args.passkey_length + ce.ANSWER_TOKENS, "--passkey-length + the answer", allow)
    model = loaded.model
    rows = ce.policy_table(
        model, loaded.tokenizer, args.policies, args.budgets, prefix=args.prefix, continuation=args.continuation,
        calibration=_calibration(loaded, parsed, None), corpus=loaded.corpus,
        samples=args.samples, context=args.context, passkey_length=args.passkey_length, bos=loaded.bos,
    )
    title = (f"{model.config.name}: {args.samples} x ({args.prefix}-token prefix + {args.continuation} scored), "
             f"decode at {args.context} tokens")
    print(ce.render_policy_table(rows, title))
    out = _compare_dir(args) / f"policies-{model.config.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(f"wrote {out}")


def _cmd_serve_bench(args) -> None:
    from kvjax.compress import parse_policy
    from kvjax.engine import check_engine_policy
    from kvjax.serve_bench import Workload, render, serve_bench

    for policy in args.policies:
        check_engine_policy(parse_policy(policy))  # before any compute
    workload = Workload(requests=args.requests, prompt=tuple(args.prompt), new=tuple(args.new),
                        shared_prefix=args.shared_prefix, seed=args.seed)
    model = _bench_model(args.model, args.overrides)
    figures = serve_bench(model, workload, memory_mib=args.memory_mib, page_size=args.page_size, slots=args.slots,
                          chunk=args.chunk, decode_steps=args.decode_steps, policies=tuple(args.policies))
    print(render(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
        print(f"wrote {args.json}")


def _bench_model(ref: str, overrides: list[str]):
    """A model config with overrides (shipped name or YAML: random weights, as throughput does not depend
    on them), or anything `load_model` takes (a run directory, a GGUF name or file, a transformers directory)."""
    from kvjax.config import CONFIG_ROOT
    from training.loading import load_model

    if ref.endswith((".yaml", ".yml")) or (CONFIG_ROOT / "models" / f"{ref}.yaml").is_file():
        from flax import nnx

        from architectures import Decoder

        return Decoder(load_config(ref, overrides).model, rngs=nnx.Rngs(0))
    if overrides:
        raise ConfigError(f"overrides {overrides} apply to a model config; {ref!r} is a trained or imported model")
    return load_model(ref).model


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="analytic KV-cache memory of model configs")
    mem.add_argument("configs", nargs="+", help="YAML paths or shipped names, then key.sub=value overrides")
    mem.add_argument("--tokens", type=POSITIVE, nargs="+", default=[4096, 32768],
                     help="sequence lengths of the cache columns (default: 4096 32768)")
    mem.add_argument("--batch", type=POSITIVE, default=1, help="sequences per cache (default: 1)")
    mem.set_defaults(run=_cmd_memory)

    train = sub.add_parser("train", help="train (or resume) a model on a corpus")
    train.add_argument("config", nargs="+", help="a YAML path or shipped name, or a run directory to resume "
                       "(its config.yaml; raise train.steps=N to extend a finished run), then key.sub=value overrides")
    train.add_argument("--run-dir", help="where checkpoints and metrics go (default runs/<model name>)")
    train.set_defaults(run=_cmd_train)

    model_help = "a run directory, a Hugging Face checkpoint directory, a .gguf file, or a shipped model (smollm2)"
    long_help = "go past the model's trained context (data.seq_len of a run; the GGUF file's context_length)"
    ev = sub.add_parser(
        "eval", help="perplexity on a validation split, or quality under compressed caches (--policy, --task)"
    )
    ev.add_argument("model", help=model_help)
    ev.add_argument("--corpus", help="corpus spec (default: the run's own; kjv for GGUF models)")
    ev.add_argument("--seq-len", type=POSITIVE, help="ppl: window length (default: the run's data.seq_len)")
    ev.add_argument("--windows", type=POSITIVE, default=64, help="ppl: how many validation windows (default: 64)")
    ev.add_argument("--batch", type=POSITIVE, default=4, help="sequences per forward pass (default: 4)")
    ev.add_argument("--policy", action="append", help="a compression policy, e.g. snapkv:0.5 (repeatable)")
    ev.add_argument("--task", choices=("ppl", "continuation", "passkey", "needle"),
                    help="default: ppl, or continuation when --policy is given")
    ev.add_argument("--prefix", type=POSITIVE,
                    help=f"continuation: prefix tokens compressed (default: {PREFIX}, or what the model's context "
                         "leaves after the continuation)")
    ev.add_argument("--continuation", type=POSITIVE,
                    help=f"continuation: tokens scored after the prefix, each predicted through the compressed "
                         f"cache (default: {CONTINUATION}, at most a quarter of the model's context; one more token "
                         "is read, the one the prefill predicts)")
    ev.add_argument("--samples", type=POSITIVE, default=1,
                    help="continuation: how many prefix/continuation pairs (default: 1)")
    ev.add_argument("--lengths", type=POSITIVE, nargs="+",
                    help=f"passkey/needle prompt lengths (default: {' '.join(map(str, LENGTHS))}, those the model's "
                         "context holds, else its context less the answer)")
    ev.add_argument("--depths", type=UNIT, nargs="+", default=[0.1, 0.5, 0.9],
                    help="passkey/needle depths in [0, 1] (default: 0.1 0.5 0.9)")
    ev.add_argument("--trials", type=POSITIVE, default=4, help="passkey/needle prompts per cell (default: 4)")
    ev.add_argument("--allow-long-context", action="store_true", help=long_help)
    ev.set_defaults(run=_cmd_eval)

    gen = sub.add_parser("generate", help="continue a text prompt")
    gen.add_argument("model", help=model_help)
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--bos", action=argparse.BooleanOptionalAction, help="start the prompt with BOS (default: for runs trained here)"
    )
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=200, help="tokens to generate (default: 200)")
    gen.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, default=0.8,
                     help="sampling temperature; 0 is greedy (default: 0.8)")
    gen.add_argument("--top-k", type=NON_NEGATIVE, default=0, help="sample among the k likeliest; 0 is off (default: 0)")
    gen.add_argument("--top-p", type=OPEN_UNIT, default=0.95,
                     help="nucleus sampling mass in (0, 1]; 1 is off (default: 0.95)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--policy", help="compress the cache, e.g. snapkv:0.5 or streaming:256:every=1")
    gen.add_argument("--corpus", help="palu: calibration corpus (default: the run's own; kjv for GGUF models)")
    gen.add_argument("--allow-long-context", action="store_true", help=long_help)
    gen.set_defaults(run=_cmd_generate)

    up = sub.add_parser("uptrain", help="convert a pretrained model to another KV architecture and train it briefly")
    up.add_argument("source", help=model_help)
    up.add_argument("conversion", help="mqa, gqa:kv_heads=K, cla2, cla:factor=F, mlkv:layers=M, swa:window=W, "
                    "yoco-swa:window=W, mla:d_c=R,rope_dims=D, joined by + (options pool=mean|first, "
                    "merge=mean|keep, select=norm|high); or a model config of the source's shape")
    up.add_argument("overrides", nargs="*", help="data.* and train.* overrides (an imported source starts from "
                    "seq_len 256, 100 steps of batch 4 at lr 1e-4, 10 warm-up steps, one checkpoint kept; a "
                    "train.steps=N alone scales the warm-up with it)")
    up.add_argument("--run-dir", help="where the run goes; an existing one resumes "
                    "(default: runs/uptrain/<source>-<conversion>)")
    up.set_defaults(run=_cmd_uptrain)

    duo = sub.add_parser("duo-train", help="learn DuoAttention's retrieval/streaming heads of a model (policy duo:R)")
    duo.add_argument("model", help=model_help)
    duo.add_argument("--steps", type=POSITIVE, default=200, help="optimizer steps, one sample each (default: 200)")
    duo.add_argument("--length", type=POSITIVE, default=1024, help="tokens per synthetic passkey sample (default: 1024)")
    duo.add_argument("--keys", type=POSITIVE, default=4, help="passkeys per sample (default: 4)")
    duo.add_argument("--words", type=POSITIVE, default=8, help="NATO words per passkey (default: 8)")
    duo.add_argument("--sinks", type=NON_NEGATIVE, default=64, help="streaming heads' sink tokens (default: 64)")
    duo.add_argument("--recent", type=POSITIVE, default=256, help="streaming heads' recent tokens (default: 256)")
    duo.add_argument("--lr", type=POSITIVE_FLOAT, default=0.02, help="gate learning rate (default: 0.02)")
    duo.add_argument("--reg", type=NON_NEGATIVE_FLOAT, default=0.05, help="L1 weight on the gates (default: 0.05)")
    duo.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    duo.add_argument("--corpus", help="haystack text (default: the run's own; kjv for GGUF models)")
    duo.add_argument("--out", help="pattern file (default: RUN/duo_pattern.json for a run, which duo:R then reads; "
                     "runs/duo/NAME.json for an imported model, read with duo:R:pattern=PATH; the shipped "
                     "configs/duo/ patterns are never written)")
    duo.add_argument("--overwrite", action="store_true", help="replace an existing pattern file")
    duo.add_argument("--allow-long-context", action="store_true", help=long_help)
    duo.set_defaults(run=_cmd_duo_train)

    cmp = sub.add_parser("compare", help="train every variant of an experiment and compare them")
    cmp.add_argument("--experiment", help="experiment YAML or shipped name, e.g. sharing, or uptrain (conversions "
                     "of one source, uptrained and from scratch) (default: compare)")
    cmp.add_argument("--quick", action="store_true", help="a short run, for a smoke test")
    cmp.add_argument("--variants", nargs="+", help="model configs to compare (default: the experiment's list)")
    cmp.add_argument("--seeds", type=POSITIVE, help="trainings per variant, for 95%% intervals (default: the "
                     "experiment's seeds, 1)")
    cmp.add_argument("--decode-contexts", type=POSITIVE, nargs="+", help="also decode speed at these contexts "
                     "(e.g. 512 1024 2048 4096 8192), each model alone after training, plotted to NAME-decode.png")
    cmp.add_argument("--lr-grid", type=POSITIVE_FLOAT, nargs="+", help="learning rates tried per variant on a "
                     "short budget, the best on a held-out selection split kept (default: the experiment's, none)")
    cmp.add_argument("--match-params", action="store_true", help="set each variant's model.ffn_dim so that its "
                     "parameters equal the first variant's (default: the experiment's match_params, off)")
    cmp.add_argument("--out", help="directory for the runs, tables and plot, used as given "
                     "(default: runs/compare/full, or runs/compare/quick with --quick)")
    pol = cmp.add_argument_group("policy table (token-level compression of one model)")
    pol.add_argument("--policies", nargs="+", help="methods run at every budget (snapkv streaming h2o tova keynorm, "
                     "snapkv:obs_window=16) and whole policies run as given (kivi:2 int:8 snapkv:0.5+kivi:4)")
    pol.add_argument("--model", help=f"{model_help} (default: the gqa run of this comparison)")
    pol.add_argument("--budgets", type=OPEN_UNIT, nargs="+", default=[0.25, 0.5, 0.75],
                     help="fractions of the prefix kept, in (0, 1] (default: 0.25 0.5 0.75)")
    pol.add_argument("--prefix", type=POSITIVE,
                     help=f"tokens compressed before the scored continuation (default: {PREFIX}, or what the "
                          "model's context leaves)")
    pol.add_argument("--continuation", type=POSITIVE,
                     help=f"tokens scored after the prefix through the compressed cache (default: {CONTINUATION}, "
                          "at most a quarter of the model's context)")
    pol.add_argument("--samples", type=POSITIVE, default=1, help="prefix/continuation pairs scored (default: 1)")
    pol.add_argument("--context", type=POSITIVE,
                     help=f"cache length for the decode speed (default: {DECODE_CONTEXT}, at most the model's context)")
    pol.add_argument("--passkey-length", type=POSITIVE, help="also passkey accuracy at this prompt length")
    pol.add_argument("--allow-long-context", action="store_true", help=long_help)
    cmp.set_defaults(run=_cmd_compare)

    sb = sub.add_parser("serve-bench", help="serving throughput at a fixed KV memory: paged engine vs static batches")
    sb.add_argument("model", help="a model config (random weights), " + model_help)
    sb.add_argument("overrides", nargs="*", help="key.sub=value overrides of a model config")
    sb.add_argument("--requests", type=POSITIVE, default=32, help="requests in the workload (default: 32)")
    sb.add_argument("--prompt", type=POSITIVE, nargs=2, default=[32, 256], metavar=("LO", "HI"),
                    help="prompt lengths, drawn uniformly (default: 32 256)")
    sb.add_argument("--new", type=POSITIVE, nargs=2, default=[8, 128], metavar=("LO", "HI"),
                    help="output lengths, drawn uniformly (default: 8 128)")
    sb.add_argument("--shared-prefix", type=NON_NEGATIVE, default=0, help="tokens every prompt starts with (default: 0)")
    sb.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    sb.add_argument("--memory-mib", type=POSITIVE_FLOAT, default=4.0, help="K/V memory of every server (default: 4)")
    sb.add_argument("--page-size", type=POSITIVE, default=16, help="tokens per page (default: 16)")
    sb.add_argument("--slots", type=POSITIVE, default=16, help="engine sequences decoding together (default: 16)")
    sb.add_argument("--chunk", type=POSITIVE, default=128, help="engine prefill chunk (default: 128)")
    sb.add_argument("--decode-steps", type=POSITIVE, default=8,
                    help="engine greedy decode steps per device call while no prompt prefills (default: 8)")
    sb.add_argument("--policies", nargs="+", default=[], help="also the engine with each policy: token eviction "
                    "applied after the prefill, optionally ending in int:8, e.g. snapkv:0.5 int:8 (default: none)")
    sb.add_argument("--json", help="also write the figures to this file")
    sb.set_defaults(run=_cmd_serve_bench)
    return parser


def _show_notes() -> None:
    """kvjax's own warnings (`kvjax.config.Note`) as one `kvjax: note:` line each; others as Python shows them."""
    default = warnings.showwarning
    if getattr(default, "kvjax_notes", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Note):
            print(f"kvjax: note: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.kvjax_notes = True
    warnings.showwarning = show


def as_typed(argv: list[str]) -> str:
    """This command line as the user can type it again: `kvjax ...` when `kvjax` on PATH is this program,
    else the path it was started by (e.g. `.venv/bin/kvjax`)."""
    prog = sys.argv[0]
    if Path(prog).name != "kvjax":  # python -m kvjax.cli, or called from Python
        prog = "kvjax"
    elif (found := shutil.which("kvjax")) and Path(found).resolve() == Path(prog).resolve():
        prog = "kvjax"
    return shlex.join([prog, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    _show_notes()
    try:
        args.run(args)
    except KeyboardInterrupt:
        print("kvjax: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, *_user_errors()) as e:
        from training.trainer import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):  # Ctrl-C in training: what was saved, and how to go on
            print(f"kvjax: {e}; resume with: {as_typed(argv)}", file=sys.stderr)
            return 130
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _out_of_memory(e):
            raise
        print(f"kvjax: error: out of memory ({str(e).splitlines()[0][:200]}); lower --batch, the sequence "
              "lengths or the cache capacity", file=sys.stderr)
        return 2
    return 0


def _out_of_memory(e: Exception) -> bool:
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (bad data, checkpoints, divergence): printed without a traceback."""
    from training.checkpoint import CheckpointError
    from training.data import DataError
    from training.gguf_import import GGUFError
    from training.trainer import TrainingError

    return (CheckpointError, DataError, GGUFError, TrainingError)


if __name__ == "__main__":
    sys.exit(main())

"""`kvjax serve-bench`: serving throughput at a fixed K/V memory, paged engine against static batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvjax.commands.args import (
    MODEL_HELP,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_FLOAT,
    check_output,
    renamed,
    split_overrides,
)
from kvjax.errors import ConfigError


def run(args) -> None:
    from kvjax.commands.common import resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.engine import check_engine_policy
    from kvjax.serve_bench import WORKLOADS, Workload, default_memory, probe, render, render_models, serve_bench

    names, overrides = split_overrides([args.model, *args.overrides])
    policies = args.policy or []
    for policy in policies:
        check_engine_policy(parse_policy(policy))  # before any compute
    if args.json:
        check_output(args.json, "--json", directory=False)
    if args.prompts == "":
        raise ConfigError("--prompts is empty: give random or a corpus (kjv, python-stdlib, text:PATH)")
    preset = WORKLOADS[args.workload] if args.workload else dict(prompt=(32, 256), new=(8, 128), shared_prefix=0)
    workload = Workload(
        requests=args.requests,
        prompt=tuple(args.prompt or preset["prompt"]),
        new=tuple(args.new or preset["new"]),
        shared_prefix=preset["shared_prefix"] if args.shared_prefix is None else args.shared_prefix,
        seed=args.seed,
    )
    if args.http:
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"--http needs the serve extra ({e.name} is missing): pip install 'kvjax[serve]'"
            ) from None
    if len(names) > 1 and args.http:
        raise ConfigError("--http serves one model; give one model, or drop --http to compare several")
    models = [(name, *_bench_model(name, overrides)) for name in names]
    text_name = models[0][3] if args.prompts is None else args.prompts
    texts = [None if text_name == "random" else _text_tokens(tokenizer, text_name) for _, _, tokenizer, _ in models]
    calibrations = [_calibration(tokenizer, corpus, policies) for _, _, tokenizer, corpus in models]
    # a duo stage reads each model's own learned pattern unless it names one
    resolved = [resolve_duo(policies, name, model.config.name) for name, model, _, _ in models]
    for (_, model, _, _), calibration, own in zip(models, calibrations, resolved):  # what an engine cannot serve
        for policy in (None, *own):  # (a model's layers, a policy) fails before compute
            probe(model, args.page_size, policy, calibration=calibration)
    runs, memory_mib = [], args.memory_mib
    for (name, model, tokenizer, _), text, calibration, own in zip(models, texts, calibrations, resolved):
        # one budget (the first's default), each model served alike
        memory_mib = memory_mib or default_memory(model.config, workload, text)
        figures = serve_bench(
            model,
            workload,
            memory_mib=memory_mib,
            page_size=args.page_size,
            slots=args.slots,
            chunk=args.chunk,
            decode_steps=args.decode_steps,
            policies=tuple(own),
            log=lambda line, name=name: print(f"serve-bench {name}: {line}", file=sys.stderr, flush=True),
            http=args.http,
            tokenizer=tokenizer,
            kl=not args.no_kl,
            text=text,
            text_name="random tokens" if text is None else f"from {text_name}",
            calibration=calibration,
        )
        print(render(figures))
        runs.append(figures)
    if len(runs) > 1:
        print(f"\nEvery model at {memory_mib:g} MiB of K/V and state memory:\n{render_models(runs)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(runs[0] if len(runs) == 1 else runs, indent=1))
        print(f"wrote {args.json}")


def _calibration(tokenizer, corpus: str, policies: list[str]):
    """Palu's calibration tokens for a model served under `policies`: the training split of its corpus (KJV
    for a model config's random weights), or None when no policy learns from data."""
    from kvjax.compress import needs_calibration, parse_policy
    from kvjax.training.compression_eval import calibration_tokens

    if not needs_calibration([parse_policy(p) for p in policies]):
        return None
    return calibration_tokens(tokenizer, "kjv" if corpus == "random" else corpus)


def _text_tokens(tokenizer, corpus: str):
    """The validation tokens of `corpus` in the model's tokenizer: the text prompts are passages of."""
    from kvjax.training.compression_eval import corpus_tokens
    from kvjax.training.data import DataError

    try:
        return corpus_tokens(tokenizer, corpus)
    except DataError as e:
        raise ConfigError(f"--prompts {corpus}: {e}") from None


def _bench_model(ref: str, overrides: list[str]):
    """A model config with overrides (shipped name or YAML: random weights, as throughput does not depend
    on them), or anything `load_model` takes (a run directory, a GGUF name or file, a transformers directory),
    with its tokenizer and the text its prompts default to (random tokens for random weights, else the
    model's corpus)."""
    from flax import nnx

    from kvjax.architectures import Decoder
    from kvjax.config import CONFIG_ROOT, load_config
    from kvjax.training.loading import load_model
    from kvjax.training.tokenizer import ByteTokenizer

    if ref.endswith((".yaml", ".yml")) or (CONFIG_ROOT / "models" / f"{ref}.yaml").is_file():
        return Decoder(load_config(ref, overrides).model, rngs=nnx.Rngs(0)), ByteTokenizer(), "random"
    if overrides:
        raise ConfigError(f"overrides {overrides} apply to a model config; {ref!r} is a trained or imported model")
    loaded = load_model(ref)
    return loaded.model, loaded.tokenizer, loaded.corpus


def register(sub) -> None:
    sb = sub.add_parser("serve-bench", help="serving throughput at a fixed KV memory: paged engine vs static batches")
    sb.add_argument("model", help="a model config (random weights), " + MODEL_HELP)
    sb.add_argument(
        "overrides",
        nargs="*",
        help="more model configs, to compare at one budget (gqa mla mamba ...), and key.sub=value overrides",
    )
    sb.add_argument(
        "--workload",
        choices=("chat", "long-prompt", "long-generation"),
        help="a named workload: chat (128 shared + 32-256 prompt tokens, 32-256 out), long-prompt (1-2k in, "
        "8-64 out), long-generation (16-64 in, 1-2k out); --prompt, --new, --shared-prefix override it",
    )
    sb.add_argument("--requests", type=POSITIVE, default=32, help="requests in the workload (default: 32)")
    sb.add_argument(
        "--prompt",
        type=POSITIVE,
        nargs=2,
        metavar=("LO", "HI"),
        help="prompt lengths, drawn uniformly (default: 32 256, or the --workload's)",
    )
    sb.add_argument(
        "--new",
        type=POSITIVE,
        nargs=2,
        metavar=("LO", "HI"),
        help="output lengths, drawn uniformly (default: 8 128, or the --workload's)",
    )
    sb.add_argument(
        "--shared-prefix",
        type=NON_NEGATIVE,
        help="tokens every prompt starts with (default: 0, or the --workload's)",
    )
    sb.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    sb.add_argument(
        "--prompts",
        metavar="TEXT",
        help="what prompts are made of: random (random tokens) or a corpus (kjv, python-stdlib, text:PATH) "
        "whose validation text they are passages of, so the KL column measures policies on natural text "
        "(default: the model's corpus for a trained or imported model, random tokens for a model config)",
    )
    sb.add_argument(
        "--memory-mib",
        type=POSITIVE_FLOAT,
        help="K/V memory of every server (default: what static batches need to hold a quarter of the requests)",
    )
    sb.add_argument("--page-size", type=POSITIVE, default=16, help="tokens per page (default: 16)")
    sb.add_argument("--slots", type=POSITIVE, default=16, help="engine sequences decoding together (default: 16)")
    sb.add_argument("--chunk", type=POSITIVE, default=128, help="engine prefill chunk (default: 128)")
    sb.add_argument(
        "--decode-steps",
        type=POSITIVE,
        default=8,
        help="engine greedy decode steps per device call while no prompt prefills (default: 8)",
    )
    sb.add_argument(
        "--policy",
        action="append",
        help="also the engine with this policy: token eviction applied after the prefill (and while decoding "
        "with every=N), optionally ending in int:8, int:4 or kivi (kivi:2 needs --page-size 32, 64 or 128), e.g. "
        "snapkv:0.5, h2o:256:every=64 or int:8; on sliding-window models local=true compresses the windows "
        "too (snapkv:0.5:local); "
        "repeatable (default: none)",
    )
    renamed(sb, "--policies", "give --policy once per policy (--policy snapkv:0.5 --policy int:8)")
    sb.add_argument(
        "--no-kl",
        action="store_true",
        help="skip each policy's quality cost (by default: KL against the full cache of the next-token "
        "distributions along every continuation the policy served, scored teacher-forced after the timing)",
    )
    sb.add_argument("--json", help="also write the figures to this file")
    sb.add_argument(
        "--http",
        type=POSITIVE,
        metavar="STREAMS",
        help="also serve the workload through each engine's thread and through kvjax serve's HTTP app, this "
        "many streams at once (e.g. 32): tokens/s, time to first token, gaps between chunks (default: off)",
    )
    sb.set_defaults(run=run)

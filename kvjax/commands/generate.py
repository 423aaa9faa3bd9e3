"""`kvjax generate`: continue a text prompt, optionally through a compressed cache."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvjax.commands.args import (
    LONG_HELP,
    MODEL_HELP,
    NON_NEGATIVE,
    NON_NEGATIVE_FLOAT,
    OPEN_UNIT,
    POSITIVE,
    add_tensor,
    mesh_of,
)
from kvjax.errors import ConfigError


def run(args) -> None:
    from kvjax.commands.common import calibration_tokens, check_policies, resolve_duo
    from kvjax.compress import parse_policy
    from kvjax.config import DecodingConfig
    from kvjax.generate import generate
    from kvjax.training.loading import check_context, load_model

    given = args.prompt if args.prompt is not None else prompt_file(args.prompt_file)
    policy = parse_policy(args.policy) if args.policy else None
    loaded = load_model(args.model, mesh=mesh_of(args))
    if policy is not None:
        text = resolve_duo([str(policy)], args.model, loaded.config.model.name)
        check_policies(text, loaded)
        policy = parse_policy(text[0])
    tokenizer = loaded.tokenizer
    # Runs trained here saw BOS at every document start; imported models get no special token unless asked.
    bos = args.bos if args.bos is not None else loaded.bos
    prompt = [tokenizer.bos_id, *tokenizer.encode(given)] if bos else tokenizer.encode(given)
    if not prompt:
        what = "--prompt=''" if args.prompt is not None else f"--prompt-file={args.prompt_file} is empty and"
        raise ConfigError(f"{what} gives no token; write some text, or pass --bos to start from BOS alone")
    check_context(
        loaded,
        len(prompt) + args.max_new_tokens,
        f"a prompt of {len(prompt)} tokens + --max-new-tokens={args.max_new_tokens}",
        args.allow_long_context,
    )
    decoding = DecodingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
    )
    calibration = calibration_tokens(loaded, [policy] if policy else [], args.corpus)
    out = generate(loaded.model, [prompt], decoding, policy=policy, calibration=calibration)
    print(given + completion(tokenizer, out.tokens[0, : out.lengths[0]]))


def prompt_file(path: str) -> str:
    """The text of `--prompt-file`, read before any model loads: a file of UTF-8 text."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--prompt-file={path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--prompt-file={path} is a directory; give a text file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt-file={path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"--prompt-file={path}: {e.strerror}") from None


def completion(tokenizer, tokens) -> str:
    """The generated text: the end token a generation stopped at (a chat model's `<|im_end|>`) is not text."""
    tokens = list(tokens)
    if tokens and tokens[-1] == tokenizer.eos_id:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens)


def register(sub) -> None:
    gen = sub.add_parser("generate", help="continue a text prompt")
    gen.add_argument("model", help=MODEL_HELP)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-file", help="a UTF-8 text file whose contents are the text to continue")
    gen.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        help="start the prompt with BOS (default: for runs trained here)",
    )
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=200, help="tokens to generate (default: 200)")
    gen.add_argument(
        "--temperature", type=NON_NEGATIVE_FLOAT, default=0.8, help="sampling temperature; 0 is greedy (default: 0.8)"
    )
    gen.add_argument(
        "--top-k", type=NON_NEGATIVE, default=0, help="sample among the k likeliest; 0 is off (default: 0)"
    )
    gen.add_argument(
        "--top-p", type=OPEN_UNIT, default=0.95, help="nucleus sampling mass in (0, 1]; 1 is off (default: 0.95)"
    )
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--policy", help="compress the cache, e.g. snapkv:0.5 or streaming:256:every=1")
    gen.add_argument("--corpus", help="palu: calibration corpus (default: the run's own; kjv for GGUF models)")
    gen.add_argument("--allow-long-context", action="store_true", help=LONG_HELP)
    add_tensor(gen)
    gen.set_defaults(run=run)

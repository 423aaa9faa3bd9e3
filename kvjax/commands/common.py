"""What several commands share: compression policies resolved against a model, and length defaults fitted
to its context. Imported while parsing (its defaults name help texts), so the library loads in the functions."""

from __future__ import annotations

import os
from pathlib import Path


def calibration_tokens(loaded, policies, corpus: str | None):
    """Palu's calibration tokens (the corpus's training split) when a policy needs them, else None."""
    from kvjax.compress import needs_calibration
    from kvjax.training import compression_eval as ce

    if not needs_calibration(policies):
        return None
    return ce.calibration_tokens(loaded.tokenizer, corpus or loaded.corpus)


def resolve_duo(texts: list[str], model_ref: str, model_name: str) -> list[str]:
    """Policy texts (or `--policy` methods) whose `duo` stages read the learned pattern of the model
    `model_ref` (named `model_name`; `kvjax.duo.default_pattern`, the one with the rings' gates for
    `duo:R:local`) unless they name one."""
    from kvjax.duo import default_pattern, with_pattern

    def shown(local: bool):
        path = default_pattern(model_ref, model_name, local)
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path

    return [with_pattern(text, shown(False), shown(True)) for text in texts]


def check_policies(texts: list[str], loaded) -> None:
    """Each policy fits the model (a `duo` stage's pattern exists and has every head), checked before
    any compute."""
    from kvjax.compress import check_policy, parse_policy

    for text in texts:
        check_policy(parse_policy(text), loaded.config.model)


PREFIX, CONTINUATION, DECODE_CONTEXT, LENGTHS = 1536, 255, 2048, (512, 1024)  # defaults, fitted to the model


def fit_to_context(args, loaded) -> None:
    """Defaults for the lengths the user left unset that fit the model's trained context: a quarter of it
    at most for the continuation, the rest (less the token the prefill predicts) for the prefix, the
    context itself at most for decode timings and passkey prompts. Given values are checked as given."""
    from kvjax.training import compression_eval as ce

    ctx = loaded.context or 1 << 30
    if getattr(args, "continuation", 0) is None:
        args.continuation = min(CONTINUATION, max(1, ctx // 4))
    if getattr(args, "prefix", 0) is None:
        args.prefix = min(PREFIX, max(1, ctx - args.continuation - 1))
    if getattr(args, "context", 0) is None:
        args.context = min(DECODE_CONTEXT, ctx)
    if getattr(args, "lengths", 0) is None:
        args.lengths = [n for n in LENGTHS if n + ce.ANSWER_TOKENS <= ctx] or [max(1, ctx - ce.ANSWER_TOKENS)]

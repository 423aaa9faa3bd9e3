"""Timing on a noisy machine: each figure is the median of timed rounds after an untimed one that compiles,
with every round kept so a report can show the spread. Decode timings for a model build on it."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import DecodingConfig
from kvjax.generate import Generator

PREFILL_CHUNK = 512  # decode timings prefill their prompts in chunks: an 8 x 8k prompt unchunked needs 17 GB of scores


def rounds(
    run: Callable, repeats: int, *, warmup: int = 1, setup: Callable | None = None
) -> tuple[list[float], object]:
    """(seconds of each of `repeats` calls of `run`, after `warmup` untimed ones; the last call's result).
    `setup()`, untimed, makes each call's argument (e.g. fresh copies of donated buffers); results are
    waited for (`jax.block_until_ready`) inside the timing."""
    seconds, result = [], None
    for i in range(warmup + repeats):
        args = () if setup is None else (jax.block_until_ready(setup()),)
        start = time.perf_counter()
        result = jax.block_until_ready(run(*args))
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds, result


def decode_rounds(gen: Generator, logits, caches, lengths, new_tokens: int, repeats: int, stats=None):
    """(seconds of each of `repeats` greedy decodes of `new_tokens` tokens, each from a fresh copy of the
    prefilled caches (the decode donates them), the last round's caches); one untimed round compiles."""
    decoding = DecodingConfig(max_new_tokens=new_tokens)
    seconds, result = rounds(
        lambda fresh: gen.decode(fresh, logits, lengths, decoding, jax.random.key(0), stats),
        repeats,
        setup=lambda: jax.tree.map(jnp.copy, caches),
    )
    return seconds, result.caches


def decode_timings(model, prompts: np.ndarray, new_tokens: int, repeats: int = 5) -> tuple[list[float], tuple]:
    """`decode_rounds` for a batch of prompts that, with the new tokens, fill the cache, prefilled once
    in chunks of PREFILL_CHUNK. A decode of `new_tokens` tokens takes `new_tokens - 1` forward steps."""
    gen = Generator(model, capacity=prompts.shape[1] + new_tokens)
    tokens, lengths = gen.pad(prompts.tolist(), new_tokens)
    logits, caches = gen.prefill(tokens, lengths, chunk=PREFILL_CHUNK)
    return decode_rounds(gen, logits, caches, lengths, new_tokens, repeats)


def decode_seconds(model, prompts: np.ndarray, new_tokens: int, repeats: int = 5) -> tuple[float, tuple]:
    """(the median of `decode_timings`, the final caches)."""
    seconds, caches = decode_timings(model, prompts, new_tokens, repeats)
    return float(np.median(seconds)), caches


def generation_times(model, prompts: np.ndarray, new_tokens: int, repeats: int = 5) -> tuple[float, float, tuple]:
    """(prefill seconds, decode seconds, final caches), each the median of `repeats` rounds: the decode as
    `decode_seconds`, the prefill in one pass."""
    gen = Generator(model, capacity=prompts.shape[1] + new_tokens)
    tokens, lengths = gen.pad(prompts.tolist(), new_tokens)
    prefills, (logits, caches) = rounds(lambda: gen.prefill(tokens, lengths), repeats)
    decodes, caches = decode_rounds(gen, logits, caches, lengths, new_tokens, repeats)
    return float(np.median(prefills)), float(np.median(decodes)), caches

"""Jitted batched generation: prefill, then one `lax.while_loop` of decode steps over donated caches.

Prompts of different lengths are right-padded to a bucket length; padding has position -1, so it is
never cached nor attended to, and every row continues at its own true position. The NNX model is split
once and its pure function is run through plain `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax.cache import init_caches
from kvjax.config import DecodingConfig
from kvjax.sampling import sample

MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """tokens `[B,N]` (rows that stopped early are padded with `pad_id`); logprobs `[B,N]`: log p(token)
    under the model's own distribution (temperature 1), 0 after a row stops; lengths `[B]`: tokens
    generated per row, EOS included; caches: the final caches (for memory measurement)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    caches: tuple


@struct.dataclass
class _LoopState:
    step: jax.Array  # scalar: tokens generated so far
    tokens: jax.Array  # [B,N]
    logprobs: jax.Array  # [B,N]
    done: jax.Array  # [B]
    n_generated: jax.Array  # [B]
    rng: jax.Array
    caches: tuple


def prompt_bucket(length: int, capacity: int) -> int:
    """Padded prefill length: the next power of two (at least MIN_BUCKET), capped at capacity."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), capacity)


def _prefill(graphdef, params, tokens, lengths, *, capacity):
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < lengths[:, None], idx, -1)
    last, caches = model.prefill_last(tokens, positions, init_caches(model.config, B, capacity), lengths - 1)
    return model.logits(last), caches


def _decode(graphdef, params, caches, logits, lengths, rng, *, n_new, sampling, eos_id, pad_id):
    """Sample n_new tokens: the first from the prefill logits, each next one after a decode step."""
    model = nnx.merge(graphdef, params)
    B = logits.shape[0]

    def pick(logits, rng, done):
        tok = sample(logits, rng, **dict(sampling))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], axis=-1)[:, 0]
        stop = tok == eos_id if eos_id is not None else jnp.zeros_like(done)
        return jnp.where(done, pad_id, tok), jnp.where(done, 0.0, logp), done | stop

    rng, sub = jax.random.split(rng)
    tok, logp, done = pick(logits, sub, jnp.zeros((B,), bool))
    state = _LoopState(
        step=jnp.int32(1),
        tokens=jnp.full((B, n_new), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((B, n_new), jnp.float32).at[:, 0].set(logp),
        done=done,
        n_generated=jnp.ones((B,), jnp.int32),
        rng=rng,
        caches=caches,
    )

    def cond(s: _LoopState):
        return (s.step < n_new) & ~jnp.all(s.done)

    def body(s: _LoopState):
        prev = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        pos = (lengths + s.step - 1)[:, None]
        logits, caches = model(prev, pos, s.caches)
        rng, sub = jax.random.split(s.rng)
        tok, logp, done = pick(logits[:, 0], sub, s.done)
        return _LoopState(
            step=s.step + 1,
            tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, tok[:, None], s.step, axis=1),
            logprobs=jax.lax.dynamic_update_slice_in_dim(s.logprobs, logp[:, None], s.step, axis=1),
            done=done,
            n_generated=s.n_generated + (~s.done).astype(jnp.int32),
            rng=rng,
            caches=caches,
        )

    final = jax.lax.while_loop(cond, body, state)
    return final.tokens, final.logprobs, final.n_generated, final.caches


class Generator:
    """Compiled generation for one model and cache capacity; reuse it to compile once per shape.

    The model's weights are captured when the Generator is made (`nnx.split`); make a new one after
    changing them.
    """

    def __init__(self, model: nnx.Module, *, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0")
        self.config = model.config
        self.capacity = capacity
        graphdef, self.params = nnx.split(model)
        self._prefill = jax.jit(partial(_prefill, graphdef), static_argnames=("capacity",))
        self._decode = jax.jit(
            partial(_decode, graphdef),
            static_argnames=("n_new", "sampling", "eos_id", "pad_id"),
            donate_argnames=("caches",),
        )

    def pad(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad prompts to their bucket length; checks everything before any compute."""
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt")
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.min() == 0:
            raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs >= 1 token")
        longest = int(lengths.max())
        if longest + max_new_tokens > self.capacity:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} needs {longest + max_new_tokens}"
                f" cache slots but the capacity is {self.capacity}; raise capacity or shorten the prompt"
            )
        tokens = np.zeros((len(prompts), prompt_bucket(longest, self.capacity)), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        vocab = self.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {tokens.min()}..{tokens.max()}")
        return tokens, lengths

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray) -> tuple[jax.Array, tuple]:
        """Padded prompts `[B,T]` -> next-token logits `[B,V]` and caches holding the prompts."""
        return self._prefill(self.params, tokens, lengths, capacity=self.capacity)

    def decode(
        self, caches: tuple, logits: jax.Array, lengths: np.ndarray, decoding: DecodingConfig, rng: jax.Array
    ) -> GenerationResult:
        """Sample `decoding.max_new_tokens` tokens after a prefill; the caches are donated (consumed)."""
        sampling = (("temperature", decoding.temperature), ("top_k", decoding.top_k), ("top_p", decoding.top_p))
        out, logprobs, n_generated, caches = self._decode(
            self.params,
            caches,
            logits,
            jnp.asarray(lengths),
            rng,
            n_new=decoding.max_new_tokens,
            sampling=sampling,
            eos_id=decoding.eos_id,
            pad_id=decoding.eos_id or 0,
        )
        return GenerationResult(np.asarray(out), np.asarray(logprobs), np.asarray(n_generated), caches)

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        decoding: DecodingConfig = DecodingConfig(),
        *,
        rng: jax.Array | None = None,
    ) -> GenerationResult:
        tokens, lengths = self.pad(prompts, decoding.max_new_tokens)
        rng = jax.random.key(decoding.seed) if rng is None else rng
        logits, caches = self.prefill(tokens, lengths)
        return self.decode(caches, logits, lengths, decoding, rng)


def default_capacity(prompts: Sequence[Sequence[int]], max_new_tokens: int, multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that holds the longest prompt plus the new tokens."""
    need = max((len(p) for p in prompts), default=1) + max_new_tokens
    return -(-need // multiple) * multiple


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    decoding: DecodingConfig = DecodingConfig(),
    *,
    capacity: int | None = None,
    rng: jax.Array | None = None,
) -> GenerationResult:
    """Generate from a batch of token-id prompts. One-off convenience; use `Generator` to reuse compiles."""
    capacity = default_capacity(prompts, decoding.max_new_tokens) if capacity is None else capacity
    return Generator(model, capacity=capacity)(prompts, decoding, rng=rng)

"""Jitted batched generation: prefill, then one `lax.while_loop` of decode steps over donated caches.

Prompts of different lengths are right-padded to a bucket length; padding has position -1, so it is
never cached nor attended to, and every row continues at its own true position. The NNX model is split
once and its pure function is run through plain `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from kvjax.cache import KVCache, LatentCache, RingKVCache
from kvjax.compress import (
    Policy,
    check_policy,
    compress_caches,
    compressed_cache_bytes,
    compressible,
    plan_stages,
    prepare_policy,
)
from kvjax.compress.apply import observe_fn
from kvjax.compress.scorers import accumulates, observed_queries
from kvjax.config import ConfigError, DecodingConfig
from kvjax.memory import cache_bytes
from kvjax.plan import init_caches
from kvjax.quant.cache import QuantKVCache
from kvjax.sampling import sample
from kvjax.sharding import axis, check_mesh, place_params

MIN_BUCKET = 8
FINE_BUCKETS_FROM = 1024  # prompts longer than this are padded to quarter-octave buckets


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """tokens `[B,N]` (rows that stopped early are padded with `pad_id`); logprobs `[B,N]`: log p(token)
    under the model's own distribution (temperature 1), 0 after a row stops; lengths `[B]`: tokens
    generated per row, EOS included; caches: the final caches (for memory measurement); stats: per cache,
    the decode-time policy's running scorer statistic (H2O's attention sums), else None."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    caches: tuple
    stats: tuple = ()


@struct.dataclass
class _LoopState:
    step: jax.Array  # scalar: tokens generated so far
    tokens: jax.Array  # [B,N]
    logprobs: jax.Array  # [B,N]
    done: jax.Array  # [B]
    n_generated: jax.Array  # [B]
    rng: jax.Array
    caches: tuple
    stats: tuple  # per cache: the decode-time policy's running statistic (H2O's attention sums), or None


def length_bucket(length: int) -> int:
    """The next power of two (at least MIN_BUCKET) up to FINE_BUCKETS_FROM tokens; above, the next multiple
    of a quarter of the power of two below the length (1,280, 1,536, 1,792, 2,048, 2,560, ...), so a long
    prompt computes at most 25% padding (a 1,100-token prompt 1,280, not 2,048) for four compiles per
    doubling of the length."""
    if length <= FINE_BUCKETS_FROM:
        return max(MIN_BUCKET, 1 << (length - 1).bit_length())
    step = 1 << ((length - 1).bit_length() - 3)
    return -(-length // step) * step


def prompt_bucket(length: int, capacity: int) -> int:
    """Padded prefill length: `length_bucket`, capped at capacity."""
    return min(length_bucket(length), capacity)


def _prefill(graphdef, params, tokens, lengths, *, capacity):
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < lengths[:, None], idx, -1)
    last, caches = model.prefill_last(
        tokens, positions, init_caches(model.config, B, capacity, fresh=True), lengths - 1
    )
    return model.logits(last), caches


def _prefill_chunk(graphdef, params, caches, hidden, tokens, lengths, start):
    """One chunk `[B,C]` of a chunked prefill, starting at column `start`, into caches already holding
    the columns before it; `hidden` `[B,D]` gains the final hidden state of each row whose last prompt
    token falls in this chunk."""
    model = nnx.merge(graphdef, params)
    C = tokens.shape[1]
    idx = start + jnp.arange(C, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < lengths[:, None], idx, -1)
    last = lengths - 1 - start
    out, caches = model.prefill_last(tokens, positions, caches, jnp.clip(last, 0, C - 1))
    return jnp.where(((last >= 0) & (last < C))[:, None], out, hidden.astype(out.dtype)), caches


def _observe_prompt(model, tokens, lengths, obs_index, stages, capacity, prefix=None):
    """Prefill that observes the attention the stages' scorers need: (hidden, caches, observed). Runs
    every layer on every prompt token (no early exit): the scorers read every producer's queries. With
    `prefix` (caches holding every prompt's first `start` tokens, `start`), `tokens` start at `start`."""
    B, T = tokens.shape
    caches, start = (init_caches(model.config, B, capacity, fresh=True), 0) if prefix is None else prefix
    idx = start + jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = jnp.where(idx < lengths[:, None], idx, -1)
    rings = any(st.local for st in stages)  # a policy that compresses sliding-window rings scores them too
    return model.observe(tokens, positions, caches, obs_index, observe_fn(stages), rings=rings)


def _last_logits(model, hidden, lengths):
    return model.logits(jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0])


def _prefill_compressed(
    graphdef, params, tokens, lengths, obs_index, arrays, prefix=None, *, capacity, statics, slots, whole=False
):
    """Prefill that observes the attention the policy's scorers need, then compresses the caches. With
    `prefix` (caches holding every prompt's first `start` tokens, `start`), `tokens` are the prompts from
    position `start` on (obs_index indexes them), and only they are computed. `whole`: also return the
    caches as they were before compression."""
    model = nnx.merge(graphdef, params)
    stages = tuple(static[0] for static in statics)
    hidden, before, observed = _observe_prompt(model, tokens, lengths, obs_index, stages, capacity, prefix)
    caches, stats = compress_caches(before, observed, statics, arrays, lengths - 1, slots)
    logits = _last_logits(model, hidden, lengths - (0 if prefix is None else prefix[1]))
    return (logits, caches, stats, before) if whole else (logits, caches, stats)


def _prefill_observed(graphdef, params, tokens, lengths, obs_index, *, capacity, stages):
    """An observed prefill left uncompressed: (logits, caches, per cache each stage's statistic)."""
    model = nnx.merge(graphdef, params)
    hidden, caches, observed = _observe_prompt(model, tokens, lengths, obs_index, stages, capacity)
    return _last_logits(model, hidden, lengths), caches, observed


def _prefill_densities(graphdef, params, tokens, lengths, obs_index, *, capacity, stages, slots):
    """The first half of a method that plans layer budgets at the prefill (D2O): the observed prefill
    and each compressible layer's density `[n, B]` (`Method.layer_density`), which the host turns into
    layer budgets before compressing."""
    model = nnx.merge(graphdef, params)
    hidden, caches, observed = _observe_prompt(model, tokens, lengths, obs_index, stages, capacity)
    method = stages[-1].hooks
    sigma = jnp.stack([method.layer_density(observed[s][-1], caches[s].pos) for s in slots])
    return _last_logits(model, hidden, lengths), caches, observed, sigma


def _decode_step(model, tokens, pos, caches, stats, step, evict):
    """One decode step; with `evict` (the decode-time policy: static, arrays, slots) the step also
    observes its query's attention and, every `every` steps, evicts back to the budget."""
    if evict is None:
        logits, caches = model(tokens, pos, caches)
        return logits, caches, stats
    static, arrays, slots = evict
    stage = static[0]
    obs = jnp.zeros(tokens.shape, jnp.int32)
    hidden, caches, observed = model.observe(tokens, pos, caches, obs, observe_fn((stage,)))
    running = tuple(
        None if o is None or o[0] is None else (o[0] + _unheld(st, c, pos) if accumulates(stage) else o[0])
        for o, st, c in zip(observed, stats, caches)
    )
    as_observed = tuple(None if st is None else (st,) for st in running)

    def compress(caches, running):
        return compress_caches(caches, as_observed, (static,), (arrays,), pos[:, 0], slots, evicts=stage.every)

    caches, stats = jax.lax.cond(step % stage.every == 0, compress, lambda c, r: (c, r), caches, running)
    return model.logits(hidden), caches, stats


def _unheld(stat, cache, pos):
    """A running statistic `[B,Kh,S]` with the slots the step's token `pos` `[B,1]` went to at zero: a new
    token's sum starts from nothing, also where a compressed ring wrote it over an older token's slot."""
    if not isinstance(stat, jax.Array):
        return stat
    held = cache.pos if cache.pos.ndim == 3 else cache.pos[:, None]
    return jnp.where(held == pos[:, :, None], 0, stat)


def _decode(
    graphdef,
    params,
    caches,
    logits,
    lengths,
    rng,
    stats,
    evict_arrays,
    n_new,
    *,
    width,
    sampling,
    eos_id,
    pad_id,
    evict,
):
    """Sample n_new (a scalar) tokens: the first from the prefill logits, each next one after a decode step, into
    buffers of `width` >= n_new columns (`length_bucket`: nearby generation lengths share a compile)."""
    model = nnx.merge(graphdef, params)
    B = logits.shape[0]
    evict = None if evict is None else (evict[0], evict_arrays, evict[1])

    def pick(logits, rng, done):
        tok = sample(logits, rng, **dict(sampling))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], axis=-1)[:, 0]
        stop = tok == eos_id if eos_id is not None else jnp.zeros_like(done)
        return jnp.where(done, pad_id, tok), jnp.where(done, 0.0, logp), done | stop

    rng, sub = jax.random.split(rng)
    tok, logp, done = pick(logits, sub, jnp.zeros((B,), bool))
    state = _LoopState(
        step=jnp.int32(1),
        tokens=jnp.full((B, width), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((B, width), jnp.float32).at[:, 0].set(logp),
        done=done,
        n_generated=jnp.ones((B,), jnp.int32),
        rng=rng,
        caches=caches,
        stats=stats,
    )

    def cond(s: _LoopState):
        return (s.step < n_new) & ~jnp.all(s.done)

    def body(s: _LoopState):
        prev = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
        pos = (lengths + s.step - 1)[:, None]
        logits, caches, stats = _decode_step(model, prev, pos, s.caches, s.stats, s.step, evict)
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
            stats=stats,
        )

    final = jax.lax.while_loop(cond, body, state)
    return final.tokens, final.logprobs, final.n_generated, final.caches, final.stats


def _forced(model, caches, stats, logits, lengths, forced, evict, out=lambda logits, tok: None, count=None):
    """Feed forced tokens `[B,N]` after rows of `lengths` tokens, one decode step each (with the decode-time
    eviction `evict`): (caches, stats, the logits after the last, per token `out(logits before it, it)`).
    `count` (a scalar): only the first `count` columns are fed, the rest padding (so that forced tokens of
    nearby lengths share a compile)."""

    def step_on(carry, tok):
        caches, stats, logits, step = carry
        pos = (lengths + step)[:, None]
        new_logits, caches, stats = _decode_step(model, tok[:, None], pos, caches, stats, step + 1, evict)
        return caches, stats, new_logits[:, 0], step + 1

    def body(carry, tok):
        fed = (
            step_on(carry, tok)
            if count is None
            else jax.lax.cond(carry[3] < count, step_on, lambda c, t: c, carry, tok)
        )
        return fed, out(carry[2], tok)

    (caches, stats, last, _), outs = jax.lax.scan(body, (caches, stats, logits, jnp.int32(0)), forced.T)
    return caches, stats, last, outs


def _score(graphdef, params, caches, logits, lengths, stats, evict_arrays, forced, *, evict, keep_logits):
    """Teacher forcing: log p(forced[:, i] | prompt, forced[:, :i]) for each i, feeding the forced tokens
    through the same decode step (and decode-time eviction) as generation."""
    model = nnx.merge(graphdef, params)
    evict = None if evict is None else (evict[0], evict_arrays, evict[1])

    def scored(logits, tok):
        logp = jax.nn.log_softmax(logits)
        return jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], logp if keep_logits else None

    # The last forced token is only scored, never fed: N - 1 decode steps for N tokens.
    _, _, last, (logprobs, full) = _forced(model, caches, stats, logits, lengths, forced[:, :-1], evict, scored)
    last_logp, last_full = scored(last, forced[:, -1])
    logprobs = jnp.concatenate([logprobs.T, last_logp[:, None]], axis=1)
    if full is None:
        return logprobs, None
    return logprobs, jnp.concatenate([full.transpose(1, 0, 2), last_full[:, None]], axis=1)


def _takes_chunks(cache) -> bool:
    """Whether a chunk through `cache` attends as its tokens fed one decode step each would: slot caches
    (compressed or not), whole rings, latents and per-token int codes do; KIVI's residual (flushed between
    a chunk's tokens), Quest's pages (chosen per decode query), a compressed ring (one token at a time) and
    the other layouts are fed step by step."""
    if isinstance(cache, QuantKVCache):  # codes per token and nothing else: a chunk's tokens are coded alike
        return cache.spec.scheme.plain and not cache.spec.blocked
    return type(cache) in (KVCache, RingKVCache, LatentCache)


def _feed(graphdef, params, caches, lengths, stats, evict_arrays, forced, count, *, evict, stepwise):
    """A question after its compressed context (kvpress's query-agnostic protocol): the first `count` forced
    tokens (the rest padding) fed through the cache; (logits after the last `[B,V]`, caches, stats). As one
    chunk (one pass, as kvpress prefills the question) where that equals feeding it token by token
    (`_takes_chunks`); else, under decode-time eviction (which may fire between its tokens) or when
    `stepwise` asks, one decode step per token."""
    model = nnx.merge(graphdef, params)
    if evict is None and not stepwise and all(map(_takes_chunks, caches)):
        idx = jnp.arange(forced.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.where(idx < count, lengths[:, None] + idx, -1)
        hidden, caches = model.prefill_last(forced, positions, caches, jnp.full(lengths.shape, count - 1))
        return model.logits(hidden), caches, stats
    evict = None if evict is None else (evict[0], evict_arrays, evict[1])
    logits = jnp.zeros((forced.shape[0], model.config.vocab_size), jnp.float32)  # read by no step
    caches, stats, last, _ = _forced(model, caches, stats, logits, lengths, forced, evict, count=count)
    return last, caches, stats


@functools.lru_cache(maxsize=16)
def _programs(graphdef) -> SimpleNamespace:
    """The jitted programs of one model structure, shared by every Generator of it: jax caches what it
    compiles per jitted function, so a second Generator of the same model (another policy, another
    capacity) traces and compiles only the programs whose static arguments or shapes differ."""
    return SimpleNamespace(
        prefill=jax.jit(partial(_prefill, graphdef), static_argnames=("capacity",)),
        prefill_chunk=jax.jit(partial(_prefill_chunk, graphdef), donate_argnums=(1, 2)),
        logits=jax.jit(partial(_logits, graphdef)),
        prefill_compressed=jax.jit(
            partial(_prefill_compressed, graphdef), static_argnames=("capacity", "statics", "slots", "whole")
        ),
        prefill_observed=jax.jit(partial(_prefill_observed, graphdef), static_argnames=("capacity", "stages")),
        prefill_densities=jax.jit(
            partial(_prefill_densities, graphdef), static_argnames=("capacity", "stages", "slots")
        ),
        decode=jax.jit(
            partial(_decode, graphdef),
            static_argnames=("width", "sampling", "eos_id", "pad_id", "evict"),
            donate_argnames=("caches",),
        ),
        score=jax.jit(partial(_score, graphdef), static_argnames=("evict", "keep_logits")),
        feed=jax.jit(partial(_feed, graphdef), static_argnames=("evict", "stepwise"), donate_argnames=("caches",)),
    )


def sampling_args(decoding: DecodingConfig) -> tuple:
    """The decode program's static `sampling` argument: the DecodingConfig's sampling fields, hashable."""
    return (("temperature", decoding.temperature), ("top_k", decoding.top_k), ("top_p", decoding.top_p))


def _logits(graphdef, params, hidden):
    return nnx.merge(graphdef, params).logits(hidden)


_COMPRESS = jax.jit(compress_caches, static_argnames=("statics", "slots"))
QUESTION_BUCKET = 16  # `Generator.answer` pads a question to a multiple of this: one compile for nearby lengths


def answer_room(question_length: int, max_new_tokens: int) -> int:
    """The slots a context's cache leaves for `Generator.answer`: its question padded to QUESTION_BUCKET,
    then the new tokens; so questions a few tokens apart give caches of one shape (one compile, not one
    per sample)."""
    return -(-question_length // QUESTION_BUCKET) * QUESTION_BUCKET + max_new_tokens


class Generator:
    """Compiled generation for one model, cache capacity and (optional) compression policy; reuse it to
    compile once per shape.

    `capacity` is the prefill cache: it must hold the prompt plus the new tokens, or only the prompt
    when the policy holds a fixed budget during decoding (`every=`). The model's weights are captured
    when the Generator is made (`nnx.split`); make a new one after changing them.

    `mesh` (axes among `data`, `fsdp`, `tensor`; `kvjax.sharding.generation_mesh`) spreads generation over
    devices: the weights by `kvjax.sharding.param_spec` (attention heads and MLP hidden units over
    `tensor`), the prompts' rows over `data`, and so the caches (rows over `data`, KV heads over `tensor`),
    for a model or a context one device cannot hold. Same tokens as on one device.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        capacity: int,
        policy: Policy | None = None,
        calibration: np.ndarray | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0")
        graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        if mesh is not None:
            check_mesh(mesh, model.config)
            self.params = place_params(self.params, mesh)
        if not all(x.is_fully_addressable for x in jax.tree.leaves(self.params)):
            raise ValueError(
                "the model's weights are spread over several processes, and generation runs in one: "
                "give it a whole copy (Trainer.model gathers one)"
            )
        self.config = model.config
        self.capacity = capacity
        self.policy = policy
        self._prepared = {}  # what the policy's methods computed from the model (`prepare_policy`)
        if policy is not None:
            check_policy(policy, self.config)
            self._prepared = prepare_policy(policy, model, calibration)
        self._graphdef = graphdef
        programs = _programs(graphdef)
        self._prefill, self._prefill_chunk, self._logits = programs.prefill, programs.prefill_chunk, programs.logits
        self._prefill_compressed, self._prefill_densities = programs.prefill_compressed, programs.prefill_densities
        self._compress, self._decode, self._score = _COMPRESS, programs.decode, programs.score
        self._feed = programs.feed
        self._layer_counts = None  # (lengths, tokens kept per cache and row) of the last prefill (D2O)

    @property
    def prepared(self) -> dict:
        """What the policy's methods computed from the model (`prepare_policy`: Palu's and LoRC's bases per
        compressible cache, DuoAttention's streaming heads)."""
        return self._prepared

    @property
    def layer_counts(self) -> np.ndarray | None:
        """Tokens each compressible cache keeps per row `[n, B]`, planned at the last prefill by a method
        whose budgets come from it (D2O); None otherwise."""
        return None if self._layer_counts is None else self._layer_counts[1]

    @property
    def _budgets_at_prefill(self) -> bool:
        return self.policy is not None and self.policy.budgets_at_prefill

    @property
    def _holds_budget(self) -> bool:
        return self.policy is not None and self.policy.decode_stage is not None

    def _rows(self, *arrays) -> tuple:
        """Per-row arrays (first axis: the prompts) laid over the mesh's `data` axis; as given without one."""
        if self.mesh is None or axis(self.mesh, "data") == 1:
            return arrays
        rows = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("data"))
        return tuple(jax.device_put(x, rows) for x in arrays)

    def pad(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad prompts to their bucket length; checks everything before any compute."""
        if len(prompts) == 0:
            raise ValueError("prompts must hold at least one prompt")
        if self.mesh is not None and len(prompts) % axis(self.mesh, "data"):
            raise ConfigError(
                f"{len(prompts)} prompts do not split over mesh data={axis(self.mesh, 'data')}: give a multiple"
            )
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.min() == 0:
            raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs >= 1 token")
        longest = int(lengths.max())
        new = 0 if self._holds_budget else max_new_tokens
        if longest + new > self.capacity:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={new} needs {longest + new}"
                f" cache slots but the capacity is {self.capacity}; raise capacity or shorten the prompt"
            )
        tokens = np.zeros((len(prompts), prompt_bucket(longest, self.capacity)), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        vocab = self.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {tokens.min()}..{tokens.max()}")
        return tokens, lengths

    def prefill(self, tokens: np.ndarray, lengths: np.ndarray, chunk: int | None = None) -> tuple[jax.Array, tuple]:
        """Padded prompts `[B,T]` -> next-token logits `[B,V]` and caches holding the prompts. With `chunk`,
        the prompts go through the model `chunk` columns at a time, each chunk attending to the caches
        written before it: the same result (the cached-decode oracle), with attention scores of `[C, S]`
        per head instead of `[T, T]` (an 8 x 8k prefill of the small shape needs 17 GB of scores
        unchunked, 1 GB in chunks of 512); one compile per chunk size."""
        if chunk is None or chunk >= tokens.shape[1]:
            return self._prefill(self.params, *self._rows(tokens, lengths), capacity=self.capacity)
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1 (or None for one pass)")
        B, T = tokens.shape
        padded = np.zeros((B, -(-T // chunk) * chunk), np.int32)
        padded[:, :T] = tokens
        (lengths,) = self._rows(jnp.asarray(lengths, jnp.int32))
        caches = init_caches(self.config, B, self.capacity)
        (hidden,) = self._rows(jnp.zeros((B, self.config.d_model), self.config.dtype))
        for start in range(0, T, chunk):
            (columns,) = self._rows(padded[:, start : start + chunk])
            hidden, caches = self._prefill_chunk(self.params, caches, hidden, columns, lengths, jnp.int32(start))
        return self._logits(self.params, hidden), caches

    def cache_bytes(self, lengths: Sequence[int], max_new_tokens: int) -> int:
        """Analytic bytes of the caches a generation of `max_new_tokens` from prompts of `lengths` holds:
        the full caches at this generator's capacity, or the policy's compressed ones (its budgets, room
        for the new tokens). What `caches_nbytes(result.caches)` measures, byte for byte."""
        lengths = np.asarray(lengths, np.int32)
        if self.policy is None:
            return cache_bytes(self.config, self.capacity, len(lengths))
        plans = self.compression_plan(lengths, max_new_tokens)
        return compressed_cache_bytes(self.config, plans, len(lengths), self.capacity)

    def compression_plan(
        self, lengths: np.ndarray, max_new_tokens: int, sized_for: int | None = None, layer_counts=None
    ):
        """The policy's budgets for prompts of `lengths` (checked here, before any compute). `sized_for`:
        size the compressed caches' slots for prompts of that many tokens (>= every length; the unused
        slots stay empty), so that prompts of one bucket share a compile. `layer_counts` `[n, B]`: the tokens
        each compressible cache keeps where the method plans them at the prefill (D2O), by default what the
        last prefill of these prompts planned (the engine plans its pages for the most a prompt may keep)."""
        decode = self.policy.decode_stage
        headroom = decode.every if decode is not None else max_new_tokens
        counts = layer_counts
        if self._budgets_at_prefill and counts is None:
            if self._layer_counts is None or not np.array_equal(self._layer_counts[0], lengths):
                raise ConfigError(
                    f"policy stage {self.policy.stages[-1].method!r} plans its layer budgets at the prefill: "
                    "prefill these prompts first (prefill_compressed)"
                )
            counts = self._layer_counts[1]
        plans = plan_stages(self.config, self.policy.stages, lengths, headroom, layer_counts=counts, **self._prepared)
        if sized_for is None:
            return plans
        # (D2O's: the most a layer of a prompt of sized_for keeps, `d2o.layer_counts`, its protected ones' own)
        most = np.maximum(counts.max(axis=1, keepdims=True), sized_for + 1) if counts is not None else None
        sized = plan_stages(self.config, self.policy.stages, [sized_for], headroom, layer_counts=most, **self._prepared)
        # each cache at least this prompt's own slots: under an `every=` cap PyramidKV gives a layer what a
        # prompt shorter than the cap leaves unused in another, more than the same layer keeps at sized_for
        return tuple(
            dataclasses.replace(
                p,
                keep_caps=tuple(map(max, p.keep_caps, s.keep_caps)),
                capacities=tuple(map(max, p.capacities, s.capacities)),
            )
            for p, s in zip(plans, sized)
        )

    def observed_queries(self, length: int) -> int:
        """How many of a prompt's last queries (of `length`) the policy's scorers observe: at least the
        last one, whose logits the prefill returns. A prefix before them may come from a cache."""
        return max(1, *(observed_queries(st, length) for st in self.policy.stages))

    def prefill_compressed(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        max_new_tokens: int,
        sized_for: int | None = None,
        prefix: tuple | None = None,
        whole: bool = False,
    ):
        """Prefill, then compress with the policy: (logits `[B,V]`, compressed caches, scorer statistics
        for decode-time eviction). The caches leave room for max_new_tokens (or the policy's `every`).
        `prefix` (caches at this generator's capacity holding the prompts' first `start` tokens, `start`):
        `tokens` are the rest of each prompt (its `lengths` still whole), as when a prefix cache holds
        the start of the prompts; the queries the scorers observe must all lie in that rest. `whole`: also
        return the caches as they were before compression (a prefix cache's pages are made of them)."""
        start = 0 if prefix is None else int(prefix[1])
        for n in map(int, lengths):
            if start and n - start < (seen := self.observed_queries(n)):
                raise ValueError(
                    f"a prefix of {start} tokens leaves {n - start} of a {n}-token prompt; the policy "
                    f"observes its last {seen} queries, which must be computed"
                )
        window = self.observed_queries(tokens.shape[1])
        obs_index = np.asarray(lengths)[:, None] - start - window + np.arange(window)[None, :]
        obs_index = np.where(obs_index >= 0, obs_index, -1).astype(np.int32)
        slots = compressible(self.config, self.policy.local)
        if self._budgets_at_prefill:  # layer budgets from the prefill's attention, then compress
            if prefix is not None or whole:
                raise ValueError(f"policy {self.policy}: budgets planned at the prefill take whole prompts")
            logits, caches, observed, sigma = self._prefill_densities(
                self.params,
                *self._rows(tokens, lengths, obs_index),
                capacity=self.capacity,
                stages=self.policy.stages,
                slots=slots,
            )
            last = self.policy.stages[-1]
            never = int(lengths.max()) + max_new_tokens
            counts = last.hooks.layer_budgets(last, np.asarray(sigma), lengths, never)
            self._layer_counts = (np.array(lengths), counts)
            plans = self.compression_plan(lengths, max_new_tokens, sized_for)
            caches, stats = self._compress(
                caches,
                observed,
                tuple(p.static for p in plans),
                tuple(p.arrays for p in plans),
                jnp.asarray(lengths) - 1,
                slots=slots,
            )
            return logits, caches, stats
        plans = self.compression_plan(lengths, max_new_tokens, sized_for)
        return self._prefill_compressed(
            self.params,
            *self._rows(tokens, lengths, obs_index),
            tuple(p.arrays for p in plans),
            None if prefix is None else (prefix[0], jnp.int32(start)),
            capacity=self.capacity,
            statics=tuple(p.static for p in plans),
            slots=slots,
            whole=whole,
        )

    def _evict_args(self, lengths, max_new_tokens):
        """(static, arrays) of the decode-time eviction, or (None, None)."""
        if not self._holds_budget:
            return None, None
        last = self.compression_plan(lengths, max_new_tokens)[-1]
        return (last.static, compressible(self.config, self.policy.local)), last.arrays

    def start(self, prompts, max_new_tokens: int):
        """Pad, prefill (compressing with the policy, if any): (lengths, logits, caches, stats)."""
        tokens, lengths = self.pad(prompts, max_new_tokens)
        if self.policy is None:
            logits, caches = self.prefill(tokens, lengths)
            return lengths, logits, caches, (None,) * len(caches)
        return lengths, *self.prefill_compressed(tokens, lengths, max_new_tokens)

    def score(
        self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *, keep_logits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Log-probabilities `[B,N]` of each continuation (N tokens, the same for every row) after its
        prompt, with the cache compressed by the policy; with keep_logits also the full next-token
        log-distributions `[B,N,V]` (for KL divergences)."""
        n = {len(c) for c in continuations}
        if len(n) != 1 or len(continuations) != len(prompts) or 0 in n:
            raise ValueError("continuations must be one non-empty sequence per prompt, all of the same length")
        n = n.pop()
        lengths, logits, caches, stats = self.start(prompts, n)
        evict, arrays = self._evict_args(lengths, n)
        forced = np.asarray(continuations, np.int32)
        if forced.min() < 0 or forced.max() >= self.config.vocab_size:
            raise ValueError(f"continuation token ids must be in [0, {self.config.vocab_size})")
        placed, forced = self._rows(jnp.asarray(lengths), forced)
        logprobs, full = self._score(
            self.params,
            caches,
            logits,
            placed,
            stats,
            arrays,
            forced,
            evict=evict,
            keep_logits=keep_logits,
        )
        return np.asarray(logprobs), None if full is None else np.asarray(full)

    def decode(
        self,
        caches: tuple,
        logits: jax.Array,
        lengths: np.ndarray,
        decoding: DecodingConfig,
        rng: jax.Array,
        stats: tuple | None = None,
        at: np.ndarray | None = None,
        headroom: int | None = None,
    ) -> GenerationResult:
        """Sample `decoding.max_new_tokens` tokens after a prefill; the caches are donated (consumed).
        With a policy that holds its budget, pass the `stats` that `prefill_compressed` returned. `at`: the
        rows' positions where decoding starts when tokens were fed after the prompts of `lengths` (`answer`),
        whose caches were planned with `headroom` slots for what follows them."""
        sampling, n_new = sampling_args(decoding), decoding.max_new_tokens
        evict, arrays = self._evict_args(lengths, n_new if headroom is None else headroom)
        out, logprobs, n_generated, caches, stats = self._decode(
            self.params,
            caches,
            logits,
            *self._rows(jnp.asarray(lengths if at is None else at)),
            rng,
            stats if stats is not None else (None,) * len(caches),
            arrays,
            jnp.int32(n_new),
            width=length_bucket(n_new),
            sampling=sampling,
            eos_id=decoding.eos_id,
            pad_id=decoding.eos_id or 0,
            evict=evict,
        )
        out, logprobs = np.asarray(out)[:, :n_new], np.asarray(logprobs)[:, :n_new]
        return GenerationResult(out, logprobs, np.asarray(n_generated), caches, stats)

    def answer(
        self,
        contexts: Sequence[Sequence[int]],
        questions: Sequence[Sequence[int]],
        decoding: DecodingConfig = DecodingConfig(),
        *,
        rng: jax.Array | None = None,
        prefilled: tuple | None = None,
        stepwise: bool = False,
        width: int | None = None,
    ) -> GenerationResult:
        """Question-agnostic generation (kvpress's `query_aware=False`, its leaderboard's protocol): each
        context is prefilled and compressed alone, its question (one length for every row) then fed through
        the compressed cache as one chunk (the scorers never see it; under decode-time eviction, or with
        `stepwise`, a decode step per token, eviction firing where it falls), and decoding goes on from
        there. `prefilled`: what `prefill_compressed` (or `prefill_shared`) gave for these contexts, padded
        with room for the question (padded to `width` tokens, by default the next multiple of
        QUESTION_BUCKET, `answer_room`) and the new tokens. Questions padded to one width share a compile."""
        sizes = {len(q) for q in questions}
        if len(questions) != len(contexts) or len(sizes) != 1 or 0 in sizes:
            raise ValueError("questions must be one non-empty sequence per context, all of the same length")
        forced = np.asarray(questions, np.int32)
        if forced.min() < 0 or forced.max() >= self.config.vocab_size:
            raise ValueError(f"question token ids must be in [0, {self.config.vocab_size})")
        n = forced.shape[1]
        width = answer_room(n, 0) if width is None else width
        if width < n:
            raise ValueError(f"width={width} must hold the questions' {n} tokens")
        room = width + decoding.max_new_tokens
        rng = jax.random.key(decoding.seed) if rng is None else rng
        if prefilled is None:
            lengths, logits, caches, stats = self.start(contexts, room)
        else:
            lengths, (logits, caches, stats) = np.array([len(c) for c in contexts], np.int32), prefilled
        evict, arrays = self._evict_args(lengths, room)
        padded = np.zeros((len(forced), width), np.int32)
        padded[:, :n] = forced
        placed, padded = self._rows(jnp.asarray(lengths), padded)
        stats = stats if stats is not None else (None,) * len(caches)
        logits, caches, stats = self._feed(
            self.params, caches, placed, stats, arrays, padded, jnp.int32(n), evict=evict, stepwise=stepwise
        )
        return self.decode(caches, logits, lengths, decoding, rng, stats, at=lengths + n, headroom=room)

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        decoding: DecodingConfig = DecodingConfig(),
        *,
        rng: jax.Array | None = None,
    ) -> GenerationResult:
        rng = jax.random.key(decoding.seed) if rng is None else rng
        lengths, logits, caches, stats = self.start(prompts, decoding.max_new_tokens)
        return self.decode(caches, logits, lengths, decoding, rng, stats)


def shareable(gen: Generator) -> bool:
    """Whether a Generator's policy compresses once, right after the prefill, with nothing planned from
    it first: then one observed prefill can serve it beside others (`prefill_shared`)."""
    return gen.policy is not None and not gen._holds_budget and not gen._budgets_at_prefill


def prefill_shared(gens: Sequence[Generator], tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int) -> list:
    """One observed prefill for several Generators of one model and capacity, then each policy's own
    compression of it: per Generator (logits, caches, stats), what its `prefill_compressed` returns (a
    Generator without a policy gets the prefill's own caches: the uncompressed reference shares it too).
    The prefill observes the widest window any policy needs and every stage's statistic; each method reads
    only its own queries of the window (`voters`), so its cache is the one its own prefill would give,
    with its slots sized for the prompts' bucket (`compression_plan(sized_for=)`: prompts of one bucket
    share every compile)."""
    first = gens[0]
    if any(g.config != first.config or g.capacity != first.capacity or g.mesh != first.mesh for g in gens) or not all(
        g.policy is None or shareable(g) for g in gens
    ):
        raise ValueError(
            "prefill_shared takes Generators of one model, capacity and mesh whose policies (if any) compress once"
        )
    stages = tuple(st for g in gens if g.policy is not None for st in g.policy.stages)
    window = max([1, *(observed_queries(st, tokens.shape[1]) for st in stages)])
    obs_index = np.asarray(lengths)[:, None] - window + np.arange(window)[None, :]
    obs_index = np.where(obs_index >= 0, obs_index, -1).astype(np.int32)
    logits, caches, observed = _programs(first._graphdef).prefill_observed(
        first.params, *first._rows(tokens, lengths, obs_index), capacity=first.capacity, stages=stages
    )
    out, start = [], 0
    for g in gens:
        fresh = jax.tree.map(jnp.copy, caches)  # its decode consumes them; the next policy needs the originals
        if g.policy is None:
            out.append((logits, fresh, None))
            continue
        slots = compressible(g.config, g.policy.local)
        n = len(g.policy.stages)
        mine = tuple(None if o is None else tuple(o[start : start + n]) for o in observed)
        start += n
        plans = g.compression_plan(lengths, max_new_tokens, sized_for=tokens.shape[1])
        statics, arrays = tuple(p.static for p in plans), tuple(p.arrays for p in plans)
        compressed, stats = g._compress(fresh, mine, statics, arrays, jnp.asarray(lengths) - 1, slots=slots)
        out.append((logits, compressed, stats))
    return out


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
    policy: Policy | None = None,
    calibration: np.ndarray | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> GenerationResult:
    """Generate from a batch of token-id prompts, optionally compressing the cache with `policy` (Palu's
    needs `calibration` tokens), over `mesh` if given. One-off convenience; use `Generator` to reuse compiles."""
    capacity = default_capacity(prompts, decoding.max_new_tokens) if capacity is None else capacity
    gen = Generator(model, capacity=capacity, policy=policy, calibration=calibration, mesh=mesh)
    return gen(prompts, decoding, rng=rng)

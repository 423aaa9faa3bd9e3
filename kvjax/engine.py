"""A continuous-batching engine over paged KV memory (Orca's iteration-level scheduling, Yu et al. 2022,
with vLLM's paged memory and recompute preemption, Kwon et al. 2023, sec. 4.5).

Requests wait in arrival order; one is admitted while a sequence slot is free and the pool has pages
for its prompt (after prefix-cache hits); its prompt is prefilled in chunks of `chunk` tokens, then it
joins the decode step, which advances every running sequence by one token in one jitted call over a
fixed number of slots (static shapes: one compile per chunk size and one for the step). A sequence
that finishes frees its pages at once. When a running sequence needs a page and none is free, the
newest running request is preempted: its pages are released and it waits again, to be recomputed from
its prompt and the tokens it has generated (vLLM V1's only preemption mode).

Works for attention models whose layers produce or share full-attention K/V (MHA/GQA/MQA, CLA, MLKV).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.config import ConfigError, DecodingConfig
from kvjax.paged import PagedKVCache, PagePool, PoolExhausted
from kvjax.plan import LayerPlan
from kvjax.sampling import sample


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    decoding: DecodingConfig = DecodingConfig()


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    preempted: int = 0  # times it was preempted and recomputed


@dataclasses.dataclass
class EngineStats:
    steps: int = 0  # decode steps
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    peak_pages: int = 0
    preemptions: int = 0


@dataclasses.dataclass
class _Running:
    index: int  # request index
    slot: int
    tokens: list[int]  # prompt + generated, fed or pending
    done: Completion


def _chunk_logits(graphdef, params, caches, tokens, pos, row, last):
    """Prefill a chunk `[1,C]` of sequence slot `row` (its table row as a batch of one); returns the
    log-probabilities at chunk index `last` and the caches with the written pages and the row's new length."""
    model = nnx.merge(graphdef, params)
    one = tuple(c.replace(table=c.table[row][None], length=c.length[row][None]) for c in caches)
    hidden, one = model.hidden(tokens, pos, one)
    logits = jax.nn.log_softmax(model.logits(hidden[0, last]))
    return logits, tuple(c.replace(k=o.k, v=o.v, pos=o.pos, length=c.length.at[row].set(o.length[0]))
                         for c, o in zip(caches, one))


def _step_logits(graphdef, params, caches, tokens, pos):
    """One decode step over every slot (empty slots have position -1): log-probabilities `[B,V]` and caches."""
    logits, caches = nnx.merge(graphdef, params)(tokens, pos, caches)
    return jax.nn.log_softmax(logits[:, 0]), caches


class Engine:
    """Serve requests on `model` with `n_pages` pages of `page_size` tokens per K/V-producing layer,
    `slots` sequences decoding together, prompts prefilled `chunk` tokens at a time."""

    def __init__(self, model: nnx.Module, *, n_pages: int, page_size: int = 16, slots: int = 8, chunk: int = 128,
                 max_tokens: int | None = None, prefix_cache: bool = True, mesh: jax.sharding.Mesh | None = None):
        """`mesh` (axes `data` and `tensor`) spreads the sequence slots over `data` and the pages' KV
        heads over `tensor`, as training splits batch and heads; the parameters are replicated."""
        cfg = model.config
        if set(cfg.mixers) != {"attention"} or cfg.attention.window is not None:
            raise ConfigError(f"the engine pages full-attention K/V; model mixers {sorted(set(cfg.mixers))} "
                              f"(window {cfg.attention.window}) are not supported yet")
        if slots < 1 or chunk < 1:
            raise ConfigError(f"slots={slots} and chunk={chunk} must be >= 1")
        self.model, self.pool = model, PagePool(n_pages, page_size)
        self.slots, self.chunk, self.prefix_cache = slots, chunk, prefix_cache
        self.width = -(-(max_tokens or (n_pages - 1) * page_size) // page_size)  # block-table columns
        att = cfg.attention
        producers = len(LayerPlan.from_config(cfg).producers)
        self.caches = tuple(PagedKVCache.init(n_pages, page_size, slots, self.width, att.n_kv_heads, att.head_dim,
                                              jnp.dtype(cfg.dtype)) for _ in range(producers))
        graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        if mesh is not None:
            if slots % mesh.shape["data"] or att.n_kv_heads % mesh.shape["tensor"]:
                raise ConfigError(f"slots={slots} must divide over data={mesh.shape['data']} and "
                                  f"n_kv_heads={att.n_kv_heads} over tensor={mesh.shape['tensor']}")
            self.params = jax.device_put(self.params, NamedSharding(mesh, P()))
            self.caches = tuple(self._placed(c) for c in self.caches)
        self._chunk = jax.jit(functools.partial(_chunk_logits, graphdef), donate_argnums=(1,))
        self._step = jax.jit(functools.partial(_step_logits, graphdef), donate_argnums=(1,))
        self.stats = EngineStats()

    def nbytes(self) -> int:
        """Exact bytes of the page pools, positions, block tables and lengths of every layer."""
        return sum(c.nbytes() for c in self.caches)

    # --- device state -----------------------------------------------------------------------------
    def _placed(self, cache: PagedKVCache) -> PagedKVCache:
        """A cache laid out on the mesh: pages' KV heads over `tensor`, slots' tables over `data`."""
        if self.mesh is None:
            return cache
        put = lambda x, *spec: jax.device_put(x, NamedSharding(self.mesh, P(*spec)))  # noqa: E731
        return cache.replace(k=put(cache.k, None, "tensor"), v=put(cache.v, None, "tensor"), pos=put(cache.pos),
                             table=put(cache.table, "data"), length=put(cache.length, "data"))

    def _sync(self, seqs) -> None:
        """Push the host's block tables and lengths (one row per slot, None: empty) to every layer."""
        table = self.pool.table(seqs, self.width)
        length = np.asarray([0 if s is None else self.pool.lengths[s] for s in seqs], np.int32)
        # a device copy per layer: the steps donate the caches, and a buffer may be donated once
        self.caches = tuple(self._placed(c.replace(table=jnp.asarray(table), length=jnp.asarray(length)))
                            for c in self.caches)

    def _pick(self, logp: np.ndarray, running: _Running, step: int) -> int:
        """The next token from log-probabilities `[V]` (host): argmax when greedy, else drawn with the
        request's own key (sampling a shifted copy of the logits is the same distribution)."""
        decoding = self.requests[running.index].decoding
        if decoding.temperature == 0:
            tok = int(np.argmax(logp))
        else:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(decoding.seed), running.index), step)
            tok = int(sample(jnp.asarray(logp)[None], key, temperature=decoding.temperature, top_k=decoding.top_k,
                             top_p=decoding.top_p)[0])
        running.done.tokens.append(tok)
        running.done.logprobs.append(float(logp[tok]))
        running.tokens.append(tok)
        return tok

    def _finished(self, running: _Running) -> bool:
        decoding = self.requests[running.index].decoding
        out = running.done.tokens
        return len(out) >= decoding.max_new_tokens or (decoding.eos_id is not None and out[-1] == decoding.eos_id)

    # --- scheduling -------------------------------------------------------------------------------
    def _admit(self, index: int, slot: int, slots: list) -> _Running | None:
        """Prefill request `index` into `slot` (None, taking nothing, when its pages are not free)."""
        request, done = self.requests[index], self.done[index]
        tokens = [*request.prompt, *done.tokens]  # a preempted request recomputes what it generated
        hit = self.pool.admit(index, tokens)  # full pages found in the prefix cache (none when it is off)
        try:
            self.pool.reserve(index, len(tokens) - hit)
        except PoolExhausted:
            self.pool.release(index)
            return None
        slots[slot] = index
        self.stats.cached_tokens += hit
        self.stats.prefill_tokens += len(tokens) - hit
        running = _Running(index, slot, tokens, done)
        self._sync(slots)  # the table holds every page the prompt needs; each chunk advances the row's length
        for start in range(hit, len(tokens), self.chunk):
            piece = tokens[start:start + self.chunk]
            ids = np.zeros((1, self.chunk), np.int32)
            ids[0, : len(piece)] = piece
            pos = np.full((1, self.chunk), -1, np.int32)
            pos[0, : len(piece)] = np.arange(start, start + len(piece))
            logits, self.caches = self._chunk(self.params, self.caches, jnp.asarray(ids), jnp.asarray(pos), slot,
                                              len(piece) - 1)
            self.pool.advance(index, len(piece))
        if self.prefix_cache:
            self.pool.register(index, tokens)
        self._pick(np.asarray(logits), running, len(done.tokens))
        return running

    def run(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` (in arrival order) to completion; returns one Completion per request."""
        for i, r in enumerate(requests):
            total = len(r.prompt) + r.decoding.max_new_tokens
            if not r.prompt:
                raise ConfigError(f"request {i}: the prompt is empty")
            if self.pool.pages_for(total) > min(self.width, self.pool.n_pages - 1):
                raise ConfigError(f"request {i}: {total} tokens need {self.pool.pages_for(total)} pages; a sequence "
                                  f"may hold {min(self.width, self.pool.n_pages - 1)}")
        self.requests = list(requests)
        self.done = [Completion([], []) for _ in requests]
        waiting = collections.deque(range(len(requests)))
        slots: list[int | None] = [None] * self.slots
        running: dict[int, _Running] = {}
        while waiting or running:
            while waiting and None in slots:  # admit in arrival order while slots and pages allow
                admitted = self._admit(waiting[0], slots.index(None), slots)
                if admitted is None:
                    break
                waiting.popleft()
                running[admitted.index] = admitted
                self._retire(admitted, running, slots)
            if not running:
                raise RuntimeError("no request fits the free pages")  # cannot happen: sizes are checked above
            self._grow(running, slots, waiting)
            self.stats.peak_pages = max(self.stats.peak_pages, self.pool.used_pages)
            self._sync(slots)
            ids = np.zeros((self.slots, 1), np.int32)
            pos = np.full((self.slots, 1), -1, np.int32)
            for r in running.values():
                ids[r.slot, 0], pos[r.slot, 0] = r.tokens[-1], len(r.tokens) - 1
            logits, self.caches = self._step(self.params, self.caches, jnp.asarray(ids), jnp.asarray(pos))
            self.stats.steps += 1
            logits = np.asarray(logits)
            for r in list(running.values()):
                self.pool.advance(r.index, 1)
                self._pick(logits[r.slot], r, len(r.done.tokens))
                self._retire(r, running, slots)
        return self.done

    def _retire(self, r: _Running, running: dict, slots: list) -> None:
        if r.index in running and self._finished(r):
            self.pool.release(r.index)
            slots[r.slot] = None
            del running[r.index]

    def _grow(self, running: dict, slots: list, waiting) -> None:
        """A page for every running sequence's next token, preempting the newest requests while short."""
        for r in sorted(running.values(), key=lambda r: r.index):
            while r.index in running:
                try:
                    copies = self.pool.reserve(r.index, 1)
                    self.caches = tuple(c.copy_pages(copies) for c in self.caches)
                    break
                except PoolExhausted:
                    victim = max(running.values(), key=lambda v: v.index)
                    self.pool.release(victim.index)
                    slots[victim.slot] = None
                    del running[victim.index]
                    victim.done.preempted += 1
                    self.stats.preemptions += 1
                    waiting.appendleft(victim.index)

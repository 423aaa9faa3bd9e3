"""A continuous-batching engine over paged KV memory (Orca's iteration-level scheduling, Yu et al. 2022,
with vLLM's paged memory and recompute preemption, Kwon et al. 2023, sec. 4.5).

Requests wait in arrival order; one is admitted while a sequence slot is free and the pool has pages
for its prompt (after prefix-cache hits); its prompt is prefilled in chunks of `chunk` tokens, then it
joins the decode step, which advances every running sequence by one token in one jitted call over a
fixed number of slots (static shapes: one compile per chunk size and one for the step). A sequence
that finishes frees its pages at once. When a running sequence needs a page and none is free, the
newest running request is preempted: its pages are released and it waits again, to be recomputed from
its prompt and the tokens it has generated (vLLM V1's only preemption mode).

Works for attention models whose layers produce or share full-attention K/V (MHA/GQA/MQA, CLA, MLKV)
or MLA latents (`PagedLatentCache`).

A token-level `policy` (kvjax.compress syntax) compresses each prompt as `Generator` does (one prefill
of the whole prompt, then eviction and/or `int:8` quantization), and only what is kept goes into pages:
`snapkv:0.5` takes half the prompt's pages, `int:8` pages hold 8-bit codes and a scale per token, so
more requests fit in the same memory. Decoding then appends every new token (no decode-time eviction).
With a policy, pages hold compressed prompts, so the prefix cache is off; a preempted request is
recomputed by compressing its prompt again and re-appending the tokens it generated.
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

from kvjax.cache import LatentCache
from kvjax.compress import Policy, parse_policy
from kvjax.config import ConfigError, DecodingConfig
from kvjax.generate import Generator
from kvjax.paged import PagedKVCache, PagedLatentCache, PagePool, PoolExhausted
from kvjax.plan import LayerPlan
from kvjax.quant.cache import QuantKVCache
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
    peak_running: int = 0  # most sequences decoding together
    preemptions: int = 0


@dataclasses.dataclass
class _Running:
    index: int  # request index
    slot: int
    tokens: list[int]  # prompt + generated, fed or pending
    done: Completion


# The block tables `[slots,M]` and lengths `[slots]` live once on the device, pushed from the host
# (`Engine._sync`), and every jitted function sets them into each layer's cache: one transfer per step,
# not one per layer.
def _with_rows(caches, table, length):
    return tuple(c.replace(table=table, length=length) for c in caches)


def _chunk_logits(graphdef, params, caches, table, length, tokens, pos, row, last):
    """Prefill a chunk `[1,C]` of sequence slot `row` (its table row as a batch of one); returns the
    log-probabilities at chunk index `last`, the caches with the written pages, and the lengths with
    the row's new one."""
    model = nnx.merge(graphdef, params)
    hidden, one = model.hidden(tokens, pos, _with_rows(caches, table[row][None], length[row][None]))
    logits = jax.nn.log_softmax(model.logits(hidden[0, last]))
    length = length.at[row].set(one[0].length[0])
    return logits, tuple(c.replace(**o._pools(), table=table, length=length) for c, o in zip(caches, one)), length


def _step_logits(graphdef, params, caches, table, length, tokens, pos):
    """One decode step over the first n sequence slots (tokens, pos `[n,1]`; empty slots have position
    -1): log-probabilities `[n,V]`, each row's greedy token and its log-probability `[n]` (all a greedy
    batch reads back), and the caches."""
    n = tokens.shape[0]
    logits, rows = nnx.merge(graphdef, params)(tokens, pos, _with_rows(caches, table[:n], length[:n]))
    caches = tuple(c.replace(**r._pools(), table=table, length=length) for c, r in zip(caches, rows))
    logp = jax.nn.log_softmax(logits[:, 0])
    best = jnp.argmax(logp, axis=-1)
    return logp, best, jnp.take_along_axis(logp, best[:, None], axis=-1)[:, 0], caches


@functools.lru_cache(maxsize=8)
def _jitted(graphdef) -> tuple:
    """The chunk and step functions jitted for one model structure, shared by every Engine over it (so
    a second engine on the same model compiles nothing)."""
    return (jax.jit(functools.partial(_chunk_logits, graphdef), donate_argnums=(1,)),
            jax.jit(functools.partial(_step_logits, graphdef), donate_argnums=(1,)))


@functools.partial(jax.jit, donate_argnums=0)
def _load_row(caches, table, length, dense, row):
    """Load row 0 of each layer's dense (compressed) prefill cache into sequence slot `row`'s pages;
    the caches and the lengths with the row's new one."""
    out = []
    for paged, d in zip(_with_rows(caches, table, length), dense):
        if isinstance(d, QuantKVCache):
            values = dict(k=d.k_codes[0], v=d.v_codes[0], k_scale=d.k_scale[0], v_scale=d.v_scale[0])
        elif isinstance(d, LatentCache):  # one latent "head": keys the latents, values the RoPE keys
            values = dict(k=d.c[0][None], v=d.k_rope[0][None])
        else:
            values = dict(k=d.k[0], v=d.v[0])
        out.append(paged.load(row, d.length[0], d.pos[0], **values))
    return tuple(out), out[0].length


EVICTION = ("streaming", "h2o", "snapkv", "tova", "keynorm")  # the token-eviction scorers pages support


def check_engine_policy(policy: Policy) -> tuple[bool, bool]:
    """What the engine's pages need for `policy` (positions per head, int8 codes); a policy it cannot
    page is a ConfigError naming the stage."""
    for stage in policy.stages:
        where = f"engine policy stage {stage.method!r}"
        if stage.quantizes:
            if stage.method != "int" or stage.bits != 8 or stage.asym:
                raise ConfigError(f"{where}:{stage.bits}: quantized pages are int:8 (symmetric) only")
        elif stage.method not in EVICTION:
            raise ConfigError(f"{where}: the engine pages token eviction and int:8; {stage.method} is not supported")
        elif stage.every or stage.allocator != "uniform":
            raise ConfigError(f"{where}: the engine compresses once after the prefill with one budget for every "
                              f"layer and head (every={stage.every}, allocator={stage.allocator!r} are not supported)")
    return any(s.per_head for s in policy.stages if not s.quantizes), policy.stages[-1].quantizes


class Engine:
    """Serve requests on `model` with `n_pages` pages of `page_size` tokens per K/V-producing layer,
    `slots` sequences decoding together, prompts prefilled `chunk` tokens at a time."""

    def __init__(self, model: nnx.Module, *, n_pages: int, page_size: int = 16, slots: int = 8, chunk: int = 128,
                 max_tokens: int | None = None, prefix_cache: bool = True, mesh: jax.sharding.Mesh | None = None,
                 policy: str | Policy | None = None):
        """`mesh` (axes `data` and `tensor`) spreads the sequence slots over `data` and the pages' KV
        heads over `tensor`, as training splits batch and heads; the parameters are replicated.
        `policy`: token eviction applied once after the prefill, optionally ending in `int:8` (see the
        module docstring)."""
        cfg = model.config
        if not set(cfg.mixers) <= {"attention", "mla"} or cfg.attention.window is not None:
            raise ConfigError(f"the engine pages full-attention K/V and MLA latents; model mixers "
                              f"{sorted(set(cfg.mixers))} (window {cfg.attention.window}) are not supported yet")
        if slots < 1 or chunk < 1:
            raise ConfigError(f"slots={slots} and chunk={chunk} must be >= 1")
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        self.model, self.pool = model, PagePool(n_pages, page_size)
        self.slots, self.chunk = slots, chunk
        self.prefix_cache = prefix_cache and self.policy is None
        self.width = -(-(max_tokens or (n_pages - 1) * page_size) // page_size)  # block-table columns
        att = cfg.attention
        self.gen = None
        per_head = int8 = False
        if self.policy is not None:
            per_head, int8 = check_engine_policy(self.policy)
            if int8 and "mla" in cfg.mixers:
                raise ConfigError("engine policy int:8 quantizes K/V pages; MLA's latent pages are not quantized")
            self._prefill_capacity(self.width * page_size)
        plan, mla, dtype = LayerPlan.from_config(cfg), cfg.mla, jnp.dtype(cfg.dtype)
        self.caches = tuple(
            PagedLatentCache.init(n_pages, page_size, slots, self.width, 1, mla.kv_lora_rank, dtype,
                                  value_dim=mla.rope_heads * mla.qk_rope_head_dim)
            if plan.mixers[i] == "mla" else
            PagedKVCache.init(n_pages, page_size, slots, self.width, att.n_kv_heads, att.head_dim, dtype,
                              per_head_positions=per_head, int8=int8)
            for i in plan.producers)
        graphdef, self.params = nnx.split(model)
        self._chunk, self._step = _jitted(graphdef)
        self.mesh = mesh
        if mesh is not None:
            if slots % mesh.shape["data"] or att.n_kv_heads % mesh.shape["tensor"]:
                raise ConfigError(f"slots={slots} must divide over data={mesh.shape['data']} and "
                                  f"n_kv_heads={att.n_kv_heads} over tensor={mesh.shape['tensor']}")
            self.params = jax.device_put(self.params, NamedSharding(mesh, P()))
            self.caches = tuple(self._placed(c) for c in self.caches)
        self._sync([None] * slots)
        self.stats = EngineStats()

    def reset(self) -> None:
        """Forget every sequence, the prefix cache and the statistics, keeping the compiled functions (a
        page's stale contents are never read: a row sees only the slots below its length)."""
        self.pool = PagePool(self.pool.n_pages, self.pool.page_size)
        self.stats = EngineStats()

    def nbytes(self) -> int:
        """Exact bytes of the page pools, positions, block tables and lengths of every layer."""
        return sum(c.nbytes() for c in self.caches)

    def page_nbytes(self) -> int:
        """Bytes one page takes over every K/V-producing layer."""
        return sum(c.page_nbytes for c in self.caches)

    # --- device state -----------------------------------------------------------------------------
    def _placed(self, cache: PagedKVCache) -> PagedKVCache:
        """A cache laid out on the mesh: pages' KV heads over `tensor`, slots' tables over `data`."""
        if self.mesh is None:
            return cache
        put = lambda x, *spec: jax.device_put(x, NamedSharding(self.mesh, P(*spec)))  # noqa: E731
        split = lambda n: "tensor" if n > 1 and n % self.mesh.shape["tensor"] == 0 else None  # noqa: E731
        heads = {name: put(x, None, split(x.shape[1])) for name, x in cache._pools().items()}
        return cache.replace(**heads, table=self._rows_placed(cache.table), length=self._rows_placed(cache.length))

    def _rows_placed(self, x: jax.Array) -> jax.Array:
        """Per-slot rows (tables, lengths) split over the mesh's `data` axis (as they are without a mesh)."""
        return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, P("data")))

    def _sync(self, seqs) -> None:
        """Push the host's block tables and lengths (one row per slot, None: empty) to the device, once
        for all layers (the jitted functions set them into every layer's cache)."""
        table = self.pool.table(seqs, self.width)
        length = np.asarray([0 if s is None else self.pool.lengths[s] for s in seqs], np.int32)
        self._table, self._length = self._rows_placed(jnp.asarray(table)), self._rows_placed(jnp.asarray(length))

    def _pick(self, logp, running: _Running, step: int, greedy: tuple[int, float] | None = None) -> int:
        """The next token from log-probabilities `[V]`: argmax when greedy (`greedy`, the (token,
        log-probability) the device already chose, saves reading the row), else drawn with the request's
        own key (sampling a shifted copy of the logits is the same distribution)."""
        decoding = self.requests[running.index].decoding
        if decoding.temperature == 0:
            tok = greedy[0] if greedy else int(np.argmax(logp))
            lp = greedy[1] if greedy else float(logp[tok])
        else:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(decoding.seed), running.index), step)
            tok = int(sample(jnp.asarray(logp)[None], key, temperature=decoding.temperature, top_k=decoding.top_k,
                             top_p=decoding.top_p)[0])
            lp = float(logp[tok])
        running.done.tokens.append(tok)
        running.done.logprobs.append(lp)
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
        hit = self.pool.admit(index, tokens if self.prefix_cache else None)  # full pages in the prefix cache
        if self.policy is not None:
            return self._admit_compressed(index, slot, slots, tokens)
        try:
            self.pool.reserve(index, len(tokens) - hit)
        except PoolExhausted:
            self.pool.release(index)
            return None
        slots[slot] = index
        self.stats.cached_tokens += hit
        self.stats.prefill_tokens += len(tokens) - hit
        self._sync(slots)  # the table holds every page the prompt needs; each chunk advances the row's length
        logits = self._chunks(index, slot, tokens, hit)
        if self.prefix_cache:
            self.pool.register(index, tokens)
        return self._started(index, slot, tokens, logits)

    def _admit_compressed(self, index: int, slot: int, slots: list, tokens: list[int]) -> _Running | None:
        """Prefill the prompt whole and compress it as `Generator` does, load the kept tokens into pages,
        then append what the request generated before a preemption (if anything)."""
        prompt = self.requests[index].prompt
        padded, lengths = self.gen.pad([prompt], 0)
        kept = self._kept(prompt)
        try:
            self.pool.reserve(index, kept + len(tokens) - len(prompt))
        except PoolExhausted:
            self.pool.release(index)
            return None
        slots[slot] = index
        self.stats.prefill_tokens += len(tokens)
        logits, dense, _ = self.gen.prefill_compressed(padded, lengths, 0, sized_for=padded.shape[1])
        self._sync(slots)
        self.caches, self._length = _load_row(self.caches, self._table, self._length, dense, slot)
        self.pool.advance(index, kept)
        logits = jax.nn.log_softmax(logits[0])
        if len(tokens) > len(prompt):
            logits = self._chunks(index, slot, tokens, len(prompt))
        return self._started(index, slot, tokens, logits)

    def _prefill_capacity(self, tokens: int) -> None:
        """With a policy: a Generator whose dense prefill cache holds prompts of `tokens` (a prompt may
        take more slots before compression than its pages hold after)."""
        if self.policy is not None and (self.gen is None or self.gen.capacity < tokens):
            self.gen = Generator(self.model, capacity=tokens, policy=self.policy)

    def _kept(self, prompt) -> int:
        """The slots a prompt takes in pages: all its tokens, or what the policy keeps (the same in every
        layer: budgets are uniform); an impossible budget is a ConfigError here, before any compute."""
        if self.policy is None:
            return len(prompt)
        return int(self.gen.compression_plan(np.array([len(prompt)]), 0)[-1].counts.max())

    def _chunks(self, index: int, slot: int, tokens: list[int], start: int) -> jax.Array:
        """Prefill tokens[start:] (at positions start...) into `slot`, `chunk` at a time; the last
        token's log-probabilities."""
        for at in range(start, len(tokens), self.chunk):
            piece = tokens[at:at + self.chunk]
            ids = np.zeros((1, self.chunk), np.int32)
            ids[0, : len(piece)] = piece
            pos = np.full((1, self.chunk), -1, np.int32)
            pos[0, : len(piece)] = np.arange(at, at + len(piece))
            logits, self.caches, self._length = self._chunk(self.params, self.caches, self._table, self._length,
                                                            jnp.asarray(ids), jnp.asarray(pos), slot, len(piece) - 1)
            self.pool.advance(index, len(piece))
        return logits

    def _started(self, index: int, slot: int, tokens: list[int], logits: jax.Array) -> _Running:
        running = _Running(index, slot, tokens, self.done[index])
        self._pick(np.asarray(logits), running, len(running.done.tokens))
        return running

    def check(self, requests: list[Request]) -> None:
        """Refuse, before any compute, a request this engine can never serve (an empty prompt, an
        impossible policy budget, more pages than a sequence may hold)."""
        for i, r in enumerate(requests):
            if not r.prompt:
                raise ConfigError(f"request {i}: the prompt is empty")
            total = self._kept(r.prompt) + r.decoding.max_new_tokens
            if self.pool.pages_for(total) > min(self.width, self.pool.n_pages - 1):
                raise ConfigError(f"request {i}: {total} tokens need {self.pool.pages_for(total)} pages; a sequence "
                                  f"may hold {min(self.width, self.pool.n_pages - 1)}")

    def run(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` (in arrival order) to completion; returns one Completion per request."""
        self.check(requests)
        self.requests = list(requests)
        self._prefill_capacity(max((len(r.prompt) for r in requests), default=0))
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
            self.stats.peak_running = max(self.stats.peak_running, len(running))
            self._sync(slots)
            ids = np.zeros((self._rows(running), 1), np.int32)  # the slots in use, in a power-of-two bucket
            pos = np.full((len(ids), 1), -1, np.int32)
            for r in running.values():
                ids[r.slot, 0], pos[r.slot, 0] = r.tokens[-1], len(r.tokens) - 1
            logp, best, best_lp, self.caches = self._step(self.params, self.caches, self._table, self._length,
                                                          jnp.asarray(ids), jnp.asarray(pos))
            self.stats.steps += 1
            best, best_lp = np.asarray(best), np.asarray(best_lp)
            sampling = any(self.requests[r.index].decoding.temperature > 0 for r in running.values())
            logp = np.asarray(logp) if sampling else None  # the whole distribution only when some request samples
            for r in list(running.values()):
                self.pool.advance(r.index, 1)
                self._pick(None if logp is None else logp[r.slot], r, len(r.done.tokens),
                           (int(best[r.slot]), float(best_lp[r.slot])))
                self._retire(r, running, slots)
        return self.done

    def _rows(self, running: dict) -> int:
        """Rows the decode step runs: the first slots up to the highest in use, rounded up to a power of
        two (one compile each; all slots under a mesh, whose data axis splits them)."""
        if self.mesh is not None:
            return self.slots
        used = max(r.slot for r in running.values()) + 1
        return min(self.slots, 1 << (used - 1).bit_length())

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

"""A continuous-batching engine over paged KV memory (Orca's iteration-level scheduling, Yu et al. 2022,
with vLLM's paged memory and recompute preemption, Kwon et al. 2023, sec. 4.5, and Sarathi-Serve's
stall-free batches, Agrawal et al. 2024).

Requests wait in arrival order; one is admitted while fewer than `slots` run and the pool has pages
for its prompt (after prefix-cache hits). Every step is one jitted pass that feeds one token to each
decoding sequence and, beside them, the next `chunk` tokens of the prompt being prefilled (one at a
time), so a prefill shares the weights' reads with the decode rows instead of stalling them (static
shapes: one compile per power-of-two row bucket and chunk bucket). A sequence that finishes frees its
pages at once. When a running sequence needs a page and none is free, the newest request is
preempted: its pages are released and it waits again, to be recomputed from its prompt and the tokens
it has generated (vLLM V1's only preemption mode).

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
from kvjax.page_pool import PagePool, PoolExhausted
from kvjax.paged import PagedKVCache, PagedLatentCache
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
    steps: int = 0  # passes through the model (decode rows, with or without a prompt chunk)
    calls: int = 0  # device calls: one per step, or one per `decode_steps` greedy steps
    prefill_chunks: int = 0  # steps that carried a prompt chunk
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits are not)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    peak_pages: int = 0
    peak_running: int = 0  # most sequences decoding together
    preemptions: int = 0


@dataclasses.dataclass
class _Running:
    """An admitted request: `tokens` (prompt + generated) are in its pages up to `at`; the rest is fed
    next (a prompt chunk by chunk, a generated token as a decode row)."""

    index: int  # request index
    tokens: list[int]
    done: Completion
    at: int  # tokens of `tokens` already in the pages (or, compressed, represented by them)
    fill: int  # len(tokens) at admission: tokens below it are prefill work, at and after it decoding

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.at


# The block tables `[slots,M]` and lengths `[slots]` live once on the device, pushed from the host
# (`Engine._sync`) for the sequences a step feeds, in its row order (a sequence has no fixed row: its
# pages and table say where its tokens are), and every jitted function sets them into each layer's
# cache: one transfer per step, not one per layer.
def _with_rows(caches, table, length, chunk_row=None):
    return tuple(c.replace(table=table, length=length, chunk_row=chunk_row) for c in caches)


def _forward(model, caches, table, length, tokens, pos, chunk, chunk_pos, chunk_row, last):
    """One pass over a step's tokens: a decode token for each of the first R table rows (tokens, pos
    `[R]`; position -1 where a row feeds none), then, when C > 0, a prompt chunk of row `chunk_row`
    (chunk, chunk_pos `[C]`, padded with position -1), all through the weights once (`kvjax.paged`'s
    mixed step). Returns log-probabilities `[R(+1),V]`, after each row's token and (row R) after the
    chunk's token `last`, each row's greedy token and its log-probability (all a greedy batch reads
    back), the caches and the rows' new lengths."""
    R, C = tokens.shape[0], chunk.shape[0]
    ids, at = jnp.concatenate([tokens, chunk])[None], jnp.concatenate([pos, chunk_pos])[None]
    hidden, rows = model.hidden(ids, at, _with_rows(caches, table[:R], length[:R], chunk_row))
    picked = jnp.arange(R) if C == 0 else jnp.concatenate([jnp.arange(R), R + last[None]])
    logp = jax.nn.log_softmax(model.logits(hidden[0, picked]))
    best = jnp.argmax(logp, axis=-1)
    caches = tuple(c.replace(**r._pools()) for c, r in zip(caches, rows))
    return logp, best, jnp.take_along_axis(logp, best[:, None], axis=-1)[:, 0], caches, rows[0].length


def _step(graphdef, treedef, leaves, caches, table, length, tokens, pos, chunk, chunk_pos, chunk_row, last):
    """`_forward` of the model whose parameters come as their flat leaves (`treedef` rebuilds them):
    flattening the NNX state on every call cost more host time than a small model's whole step."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return _forward(model, caches, table, length, tokens, pos, chunk, chunk_pos, chunk_row, last)[:4]


def _greedy_steps(graphdef, treedef, leaves, caches, table, length, tokens, pos, stop, eos, *, steps):
    """Up to `steps` greedy decode steps of R rows in one call (vLLM's multi-step scheduling: a small
    model's step is shorter than the host's round trip): row r feeds tokens[r] at pos[r], then each
    token it picks, for stop[r] steps (0: an empty row) or until it picks eos[r]. Returns the tokens and
    log-probabilities picked `[steps,R]` (-1 and 0 after a row stops) and the caches."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    R = tokens.shape[0]
    none = jnp.zeros(0, jnp.int32)

    def body(carry):
        i, caches, length, tok, pos, active, out_tok, out_lp = carry
        _, best, best_lp, caches, length = _forward(
            model, caches, table, length, tok, jnp.where(active, pos, -1), none, none, jnp.int32(0), jnp.int32(0)
        )
        out_tok = out_tok.at[i].set(jnp.where(active, best, -1).astype(jnp.int32))
        out_lp = out_lp.at[i].set(jnp.where(active, best_lp, 0.0))
        active = active & (i + 1 < stop) & (best != eos)
        return i + 1, caches, length, best.astype(jnp.int32), pos + 1, active, out_tok, out_lp

    def cond(carry):
        return (carry[0] < steps) & carry[5].any()

    init = (
        jnp.int32(0),
        caches,
        length[:R],
        tokens,
        pos,
        stop > 0,
        jnp.full((steps, R), -1, jnp.int32),
        jnp.zeros((steps, R), jnp.float32),
    )
    _, caches, _, _, _, _, out_tok, out_lp = jax.lax.while_loop(cond, body, init)
    return out_tok, out_lp, caches


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, treedef):
    """The step and multi-step functions jitted for one model structure, shared by every Engine over it
    (so a second engine on the same model compiles nothing)."""
    return (
        jax.jit(functools.partial(_step, graphdef, treedef), donate_argnums=(1,)),
        jax.jit(functools.partial(_greedy_steps, graphdef, treedef), donate_argnums=(1,), static_argnames=("steps",)),
    )


@functools.partial(jax.jit, donate_argnums=0)
def _load_row(caches, table, length, dense, row):
    """Load row 0 of each layer's dense (compressed) prefill cache into table row `row`'s pages;
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
            raise ConfigError(
                f"{where}: the engine compresses once after the prefill with one budget for every "
                f"layer and head (every={stage.every}, allocator={stage.allocator!r} are not supported)"
            )
    return any(s.per_head for s in policy.stages if not s.quantizes), policy.stages[-1].quantizes


class Engine:
    """Serve requests on `model` with `n_pages` pages of `page_size` tokens per K/V-producing layer, at
    most `slots` sequences admitted together, prompts prefilled `chunk` tokens a step."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        n_pages: int,
        page_size: int = 16,
        slots: int = 8,
        chunk: int = 128,
        max_tokens: int | None = None,
        prefix_cache: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        policy: str | Policy | None = None,
        decode_steps: int = 8,
    ):
        """`mesh` (axes `data` and `tensor`) spreads the step's rows (sequences) over `data` and the pages' KV
        heads over `tensor`, as training splits batch and heads; the parameters are replicated.
        `policy`: token eviction applied once after the prefill, optionally ending in `int:8` (see the
        module docstring). `decode_steps`: while no prompt is being prefilled and every running request
        decodes greedily, up to this many decode steps run in one device call (1: a call per step)."""
        cfg = model.config
        if not set(cfg.mixers) <= {"attention", "mla"} or cfg.attention.window is not None:
            raise ConfigError(
                f"the engine pages full-attention K/V and MLA latents; model mixers "
                f"{sorted(set(cfg.mixers))} (window {cfg.attention.window}) are not supported yet"
            )
        if slots < 1 or chunk < 1 or decode_steps < 1:
            raise ConfigError(f"slots={slots}, chunk={chunk} and decode_steps={decode_steps} must be >= 1")
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        self.model, self.pool = model, PagePool(n_pages, page_size)
        self.slots, self.chunk, self.decode_steps = slots, chunk, decode_steps
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
            PagedLatentCache.init(
                n_pages,
                page_size,
                slots,
                self.width,
                1,
                mla.kv_lora_rank,
                dtype,
                value_dim=mla.rope_heads * mla.qk_rope_head_dim,
            )
            if plan.mixers[i] == "mla"
            else PagedKVCache.init(
                n_pages,
                page_size,
                slots,
                self.width,
                att.n_kv_heads,
                att.head_dim,
                dtype,
                per_head_positions=per_head,
                int8=int8,
            )
            for i in plan.producers
        )
        graphdef, self.params = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(self.params)
        self._step, self._greedy_steps = _jitted(graphdef, treedef)
        self.mesh = mesh
        if mesh is not None:
            if slots % mesh.shape["data"] or att.n_kv_heads % mesh.shape["tensor"]:
                raise ConfigError(
                    f"slots={slots} must divide over data={mesh.shape['data']} and "
                    f"n_kv_heads={att.n_kv_heads} over tensor={mesh.shape['tensor']}"
                )
            self.params = jax.device_put(self.params, NamedSharding(mesh, P()))
            self._leaves = jax.tree.leaves(self.params)
            self.caches = tuple(self._placed(c) for c in self.caches)
        self._sync([])
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
        """Push the block tables and lengths of `seqs` (rows 0.., the rest of the `slots` rows empty) to
        the device, once for all layers (the jitted functions set them into every layer's cache)."""
        seqs = [*seqs, *[None] * (self.slots - len(seqs))]
        table = self.pool.table(seqs, self.width)
        length = np.asarray([0 if s is None else self.pool.lengths[s] for s in seqs], np.int32)
        self._table, self._length = self._rows_placed(table), self._rows_placed(length)  # numpy: jit moves it

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
            tok = int(
                sample(
                    jnp.asarray(logp)[None],
                    key,
                    temperature=decoding.temperature,
                    top_k=decoding.top_k,
                    top_p=decoding.top_p,
                )[0]
            )
            lp = float(logp[tok])
        running.done.tokens.append(tok)
        running.done.logprobs.append(lp)
        running.tokens.append(tok)
        return tok

    def _finished(self, running: _Running) -> bool:
        decoding = self.requests[running.index].decoding
        out = running.done.tokens
        return len(out) >= decoding.max_new_tokens or (
            decoding.eos_id is not None and bool(out) and out[-1] == decoding.eos_id
        )

    # --- scheduling -------------------------------------------------------------------------------
    def _admit(self, index: int) -> _Running | None:
        """Give request `index` pages for every token it brings (None, taking nothing, when they are not
        free); its prompt is then fed chunk by chunk by the steps."""
        request, done = self.requests[index], self.done[index]
        tokens = [*request.prompt, *done.tokens]  # a preempted request recomputes what it generated
        if self.policy is not None:
            return self._admit_compressed(index, tokens)
        hit = self.pool.admit(index, tokens if self.prefix_cache else None)  # full pages in the prefix cache
        try:
            self.pool.reserve(index, len(tokens) - hit)
        except PoolExhausted:
            self.pool.release(index)
            return None
        self.stats.cached_tokens += hit
        return _Running(index, tokens, done, at=hit, fill=len(tokens))

    def _admit_compressed(self, index: int, tokens: list[int]) -> _Running | None:
        """Prefill the prompt whole and compress it as `Generator` does and load the kept tokens into
        pages; what the request generated before a preemption (if anything) is then fed by the steps."""
        prompt = self.requests[index].prompt
        self.pool.admit(index)
        padded, lengths = self.gen.pad([prompt], 0)
        kept = self._kept(prompt)
        try:
            self.pool.reserve(index, kept + len(tokens) - len(prompt))
        except PoolExhausted:
            self.pool.release(index)
            return None
        self.stats.prefill_tokens += len(prompt)
        logits, dense, _ = self.gen.prefill_compressed(padded, lengths, 0, sized_for=padded.shape[1])
        self._sync([index])
        self.caches, self._length = _load_row(self.caches, self._table, self._length, dense, 0)
        self.pool.advance(index, kept)
        running = _Running(index, tokens, self.done[index], at=len(prompt), fill=len(tokens))
        if running.pending == 0:  # nothing was generated yet: the prefill's logits give the first token
            self._pick(np.asarray(jax.nn.log_softmax(logits[0])), running, 0)
        return running

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

    def check(self, requests: list[Request]) -> None:
        """Refuse, before any compute, a request this engine can never serve (an empty prompt, an
        impossible policy budget, more pages than a sequence may hold)."""
        for i, r in enumerate(requests):
            if not r.prompt:
                raise ConfigError(f"request {i}: the prompt is empty")
            total = self._kept(r.prompt) + r.decoding.max_new_tokens
            if self.pool.pages_for(total) > min(self.width, self.pool.n_pages - 1):
                raise ConfigError(
                    f"request {i}: {total} tokens need {self.pool.pages_for(total)} pages; a sequence "
                    f"may hold {min(self.width, self.pool.n_pages - 1)}"
                )

    def run(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` (in arrival order) to completion; returns one Completion per request.

        Each step feeds one token of every sequence that has one token left to feed (decode rows, and a
        prompt's last token) and, in the same pass, the next `chunk` tokens of the oldest sequence with
        more (a prompt being prefilled), so prefills never stall decoding (Sarathi-Serve)."""
        self.check(requests)
        self.requests = list(requests)
        self._prefill_capacity(max((len(r.prompt) for r in requests), default=0))
        self.done = [Completion([], []) for _ in requests]
        waiting = collections.deque(range(len(requests)))
        seqs: dict[int, _Running] = {}
        while waiting or seqs:
            self._admit_waiting(waiting, seqs)
            if not seqs:
                raise RuntimeError("no request fits the free pages")  # cannot happen: sizes are checked above
            rows = sorted((r for r in seqs.values() if r.pending == 1), key=lambda r: r.index)
            self._grow(rows, seqs, waiting)
            rows = [r for r in rows if r.index in seqs]
            filling = min((r for r in seqs.values() if r.pending > 1), key=lambda r: r.index, default=None)
            self.stats.peak_pages = max(self.stats.peak_pages, self.pool.used_pages)
            self.stats.peak_running = max(self.stats.peak_running, len(rows))
            if filling is not None or not self._feed_greedy(rows, seqs):
                self._feed(rows, filling, seqs)
        return self.done

    def _admit_waiting(self, waiting, seqs: dict) -> None:
        """Admit waiting requests in arrival order while fewer than `slots` run and their pages are free,
        one prompt being prefilled at a time (so pages are not reserved long before their chunks run)."""
        while waiting and len(seqs) < self.slots and not any(r.pending > 1 for r in seqs.values()):
            admitted = self._admit(waiting[0])
            if admitted is None:
                return
            waiting.popleft()
            seqs[admitted.index] = admitted
            self._retire(admitted, seqs)  # a compressed prompt may end at its first token

    def _feed(self, rows: list[_Running], filling: _Running | None, seqs: dict) -> None:
        """One step: the decode `rows` (rows 0.. of the step) and a chunk of `filling`'s pending tokens
        (the row after them; see `run`)."""
        order = rows + ([filling] if filling else [])
        R = self._rows(len(order))
        ids, pos = np.zeros(R, np.int32), np.full(R, -1, np.int32)
        for i, r in enumerate(rows):
            ids[i], pos[i] = r.tokens[r.at], r.at
        piece = filling.tokens[filling.at : filling.at + self.chunk] if filling else []
        C = self._chunk_bucket(len(piece))
        chunk, chunk_pos = np.zeros(C, np.int32), np.full(C, -1, np.int32)
        chunk[: len(piece)], chunk_pos[: len(piece)] = piece, np.arange(len(piece)) + (filling.at if filling else 0)
        self._sync([r.index for r in order])
        logp, best, best_lp, self.caches = self._step(
            self._leaves,
            self.caches,
            self._table,
            self._length,
            ids,
            pos,
            chunk,
            chunk_pos,
            np.int32(len(rows)),
            np.int32(max(len(piece) - 1, 0)),
        )
        self.stats.steps += 1
        self.stats.calls += 1
        self.stats.prefill_chunks += bool(piece)
        best, best_lp = np.asarray(best), np.asarray(best_lp)
        fed = [(r, 1, i) for i, r in enumerate(rows)] + ([(filling, len(piece), R)] if filling else [])
        sampling = any(self._samples(r) for r, _, _ in fed)
        logp = np.asarray(logp) if sampling else None  # the whole distribution only when some request samples
        for r, n, out in fed:
            self._advance(r, n, seqs, None if logp is None else logp[out], (int(best[out]), float(best_lp[out])))

    def _feed_greedy(self, rows: list[_Running], seqs: dict) -> bool:
        """Up to `decode_steps` decode steps of `rows` in one call (`_greedy_steps`), when there are several
        to run, every row decodes greedily and the pool holds pages for them all (False, nothing done,
        otherwise: the caller takes one step)."""
        stop = [self.requests[r.index].decoding.max_new_tokens - len(r.done.tokens) for r in rows]
        if self.decode_steps == 1 or not rows or max(stop) < 2 or any(self._samples(r) for r in rows):
            return False
        stop = [min(n, self.decode_steps) for n in stop]
        try:
            for r, n in zip(rows, stop):
                copies = self.pool.reserve(r.index, n)
                self.caches = tuple(c.copy_pages(copies) for c in self.caches)
        except PoolExhausted:
            return False  # what was reserved stays with its rows, which fill it later
        R = self._rows(len(rows))
        ids, pos, eos = np.zeros(R, np.int32), np.full(R, -1, np.int32), np.full(R, -1, np.int32)
        stops = np.zeros(R, np.int32)
        for i, (r, n) in enumerate(zip(rows, stop)):
            ids[i], pos[i], stops[i] = r.tokens[r.at], r.at, n
            eos[i] = -1 if self.requests[r.index].decoding.eos_id is None else self.requests[r.index].decoding.eos_id
        self._sync([r.index for r in rows])
        tokens, logprobs, self.caches = self._greedy_steps(
            self._leaves, self.caches, self._table, self._length, ids, pos, stops, eos, steps=self.decode_steps
        )
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        self.stats.steps += int((tokens >= 0).any(axis=1).sum())
        self.stats.calls += 1
        for step_tokens, step_lps in zip(tokens, logprobs):
            for r, tok, lp in zip(rows, step_tokens, step_lps):
                if tok >= 0:
                    self._advance(r, 1, seqs, None, (int(tok), float(lp)))
        return True

    def _samples(self, r: _Running) -> bool:
        return self.requests[r.index].decoding.temperature > 0

    def _advance(self, r: _Running, n: int, seqs: dict, logp, greedy: tuple[int, float]) -> None:
        """Record that n more of r's pending tokens are in its pages; after its last, pick its next token
        (from `logp` `[V]` when it samples, else `greedy`, the device's argmax and its log-probability)."""
        self.pool.advance(r.index, n)
        self.stats.prefill_tokens += max(0, min(r.at + n, r.fill) - r.at)
        r.at += n
        filled = self.pool.lengths[r.index] // self.pool.page_size
        if self.prefix_cache and filled > (self.pool.lengths[r.index] - n) // self.pool.page_size:
            self.pool.register(r.index, r.tokens)  # every page once it fills, generated ones too (vLLM V1)
        if r.pending == 0:
            self._pick(logp, r, len(r.done.tokens), greedy)
            self._retire(r, seqs)

    def _chunk_bucket(self, n: int) -> int:
        """Padded length of a prompt chunk of n tokens: 0 for none, else the next power of two from
        chunk / 8 up, capped at `chunk` (a prompt's last chunk computes at most twice its tokens, for
        four compiles per row bucket)."""
        if n == 0:
            return 0
        return min(self.chunk, max(self.chunk // 8, 1 << (n - 1).bit_length()))

    def _rows(self, n: int) -> int:
        """Rows a step of n sequences runs: n rounded up to a power of two (one compile each; all slots
        under a mesh, whose data axis splits them)."""
        if self.mesh is not None:
            return self.slots
        return min(self.slots, 1 << (n - 1).bit_length())

    def _retire(self, r: _Running, seqs: dict) -> None:
        if r.index in seqs and self._finished(r):
            self.pool.release(r.index)
            del seqs[r.index]

    def _grow(self, rows: list[_Running], seqs: dict, waiting) -> None:
        """A page for each decode row's token, preempting the newest requests while short (a prompt
        being prefilled included: its pages are released and it is recomputed later)."""
        for r in rows:
            while r.index in seqs:
                try:
                    copies = self.pool.reserve(r.index, 1)
                    self.caches = tuple(c.copy_pages(copies) for c in self.caches)
                    break
                except PoolExhausted:
                    victim = max(seqs.values(), key=lambda v: v.index)
                    self.pool.release(victim.index)
                    del seqs[victim.index]
                    victim.done.preempted += 1
                    self.stats.preemptions += 1
                    waiting.appendleft(victim.index)

"""The serving engine's host-side scheduler: plain data in, a plan out (Orca's iteration-level scheduling,
Yu et al. 2022; vLLM's admission and recompute preemption, Kwon et al. 2023, sec. 4.5; Sarathi-Serve's
stall-free batches, Agrawal et al. 2024). It decides, step by step, which requests are admitted, which
sequences feed a decode token, which prompt feeds its next chunk, which pages are copied and who is
preempted; `kvjax.engine` runs each plan on the device and reports back what was fed and picked. No
model, no jax: a schedule can be tested with a stand-in for the device.

Requests wait in arrival order; one is admitted while fewer than `slots` run, no other prompt is being
prefilled, the pool has pages for every token it brings (after prefix-cache hits) and, on a model with
sliding-window layers, their own pool has room for what its windows can hold. When a decode row
needs a page and none is free, the newest request is preempted: its pages are released and it waits at
the front, to be recomputed from its prompt and what it generated (vLLM V1's only preemption mode).
Requests may arrive while others run (`submit`) and leave before they end (`cancel`, a client gone: its
pages are freed at once).
"""

from __future__ import annotations

import collections
import dataclasses

from kvjax.config import ConfigError
from kvjax.page_pool import PagePool, PoolExhausted


@dataclasses.dataclass(frozen=True)
class Work:
    """What the scheduler knows of a request: its prompt, when it stops, whether it decodes greedily (a
    greedy sequence may run several steps in one device call), the slots its prompt takes in pages
    (`kept`: the whole prompt, or what a compression policy keeps of it) and, when the policy evicts
    while decoding, the most slots it ever holds (`cap`: its budget plus `every`); `stepwise`: after a
    preemption what it generated is re-fed one decode step per token, not as a chunk (its pages change as
    tokens arrive: eviction while decoding, KIVI's residual; a decode query reads its own pages: Quest),
    while an uncompressed prompt is still fed in chunks alone, never a prompt token as a decode row;
    `window`: the most pages its sliding-window layers' own pool holds for it while it decodes
    (`WindowPages.reserve`), reserved while it runs; `cacheable`: of a compressed prompt, the tokens a
    prefix-cache hit may cover (0: none), those before the queries its policy observes (which must be
    computed)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    eos_id: int | None = None
    greedy: bool = True
    kept: int | None = None  # None: len(prompt), uncompressed
    cap: int | None = None  # None: it grows by every token it generates
    stepwise: bool = False
    window: int = 0
    cacheable: int = 0

    @property
    def compressed(self) -> bool:
        return self.kept is not None

    @property
    def slots(self) -> int:
        """The most slots its pages hold at once."""
        total = (len(self.prompt) if self.kept is None else self.kept) + self.max_new_tokens
        return total if self.cap is None else min(total, self.cap)


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    preempted: int = 0  # times it was preempted and recomputed
    # why it ended (None while it runs): "stop" at its end token, "length" at max_new_tokens, "cancelled"
    finish: str | None = None
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # per token, when asked


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
class Sequence:
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


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Compute `seq`'s whole prompt, compress it and load what is kept into its pages (then report
    `prefilled`). Only for a compressed request: an uncompressed prompt is fed by `Step` chunks. Its first
    `cached` prompt tokens are in the prefix cache's full pages, held for it under `prefix_key(seq.index)`
    (the prefill reads them, enters the prompt's other full pages beside them, then releases the key)."""

    seq: Sequence
    cached: int = 0


def prefix_key(index: int) -> tuple[str, int]:
    """The pool key under which a compressed request's whole prompt pages are held while it prefills:
    they are the prefix cache's, not its own (its own hold what its policy keeps)."""
    return ("prefix", index)


@dataclasses.dataclass(frozen=True)
class Step:
    """One device call: first run the page `copies` (src, dst; copy-on-write), then feed one token to each
    of `rows` (its `tokens[at]`) and, beside them, `chunk` (the next tokens of `filling`, from its `at`).
    `greedy_steps` > 0 (no chunk then): every row decodes greedily for up to `stops[i]` steps of one
    call, at most `greedy_steps`, stopping at its end token."""

    rows: list[Sequence]
    filling: Sequence | None = None
    chunk: list[int] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    greedy_steps: int = 0
    stops: list[int] = dataclasses.field(default_factory=list)


class Scheduler:
    """Schedule `work` over `pool`: at most `slots` sequences admitted, prompts fed `chunk` tokens a step,
    up to `decode_steps` greedy steps in one call; `prefix_cache` reuses cached full prompt pages;
    `window_pages`: the sliding-window layers' own pool, whose pages requests are admitted against by
    their `Work.window` reservations (None: a pool that holds every slot's worst case)."""

    def __init__(
        self,
        pool: PagePool,
        *,
        slots: int,
        chunk: int,
        decode_steps: int,
        prefix_cache: bool,
        window_pages: int | None = None,
    ):
        if slots < 1 or chunk < 1 or decode_steps < 1:
            raise ConfigError(f"slots={slots}, chunk={chunk} and decode_steps={decode_steps} must be >= 1")
        self.pool, self.slots, self.chunk, self.decode_steps = pool, slots, chunk, decode_steps
        self.prefix_cache, self.window_pages = prefix_cache, window_pages
        self.stats = EngineStats()
        self.start([])

    def check(self, work: list[Work], width: int) -> None:
        """Refuse, before any compute, a request that can never be served: an empty prompt, or more pages
        than a sequence may hold (`width` block-table columns, the whole pool)."""
        for i, w in enumerate(work):
            if not w.prompt:
                raise ConfigError(f"request {i}: the prompt is empty")
            total = w.slots
            most = min(width, self.pool.n_pages - 1)
            if self.pool.pages_for(total) > most:
                raise ConfigError(
                    f"request {i}: {total} tokens need {self.pool.pages_for(total)} pages; a sequence may hold {most}"
                )
            if self.window_pages is not None and w.window > self.window_pages:
                raise ConfigError(
                    f"request {i}: its sliding-window layers hold up to {w.window} pages; their pool has "
                    f"{self.window_pages} for running requests"
                )

    def start(self, work: list[Work]) -> list[Completion]:
        """Forget every request and queue `work` in arrival order; returns the completions it fills in."""
        self.work, self.done = [], []
        self.waiting: collections.deque[int] = collections.deque()
        self.running: dict[int, Sequence] = {}
        for w in work:
            self.submit(w)
        return self.done

    def submit(self, work: Work) -> int:
        """Queue one more request behind those waiting; returns its index (its Completion: `done[index]`)."""
        self.work.append(work)
        self.done.append(Completion([], []))
        self.waiting.append(len(self.work) - 1)
        return len(self.work) - 1

    def cancel(self, index: int) -> None:
        """End request `index` now (a client gone): out of the queue or the running set, its pages freed;
        nothing if it has ended already."""
        if self.done[index].finish is not None:
            return
        if index in self.running:
            self.pool.release(index)
            del self.running[index]
        else:
            self.waiting.remove(index)
        self.done[index].finish = "cancelled"

    def forget(self, index: int) -> None:
        """Drop an ended request's prompt and completion (a long-running server keeps only its index)."""
        if self.done[index] is None or self.done[index].finish is None:
            raise ValueError(f"request {index} has not ended; cancel it first")
        self.work[index] = self.done[index] = None

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        return not (self.waiting or self.running)

    # --- planning ---------------------------------------------------------------------------------
    def next(self) -> Prefill | Step | None:
        """The next thing for the device to do; None when every request has finished."""
        if not (self.waiting or self.running):
            return None
        prefill = self._admit_waiting()
        if prefill is not None:
            return prefill
        if not self.running:
            raise RuntimeError("no request fits the free pages")  # cannot happen: `check` sized them
        rows = sorted(
            (s for s in self.running.values() if (s.pending == 1 or self._replays(s)) and not self._fills(s)),
            key=lambda s: s.index,
        )
        copies = self._grow(rows)
        rows = [s for s in rows if s.index in self.running]
        filling = min((s for s in self.running.values() if self._fills(s)), key=lambda s: s.index, default=None)
        self.stats.peak_running = max(self.stats.peak_running, len(rows))
        stops = self._greedy_stops(rows, copies) if filling is None else []
        self.stats.peak_pages = max(self.stats.peak_pages, self.pool.used_pages)  # with a multi-step call's
        if stops:
            return Step(rows, copies=copies, greedy_steps=self.decode_steps, stops=stops)
        chunk = filling.tokens[filling.at : filling.at + self.chunk] if filling else []
        if filling and self.work[filling.index].stepwise:  # the prompt in chunks, what it generated a step a token
            chunk = chunk[: len(self.work[filling.index].prompt) - filling.at]
        return Step(rows, filling, chunk, copies)

    def _admit_waiting(self) -> Prefill | None:
        """Admit waiting requests in arrival order while fewer than `slots` run and their pages are free,
        one prompt being prefilled at a time (so pages are not reserved long before their chunks run).
        A compressed request is prefilled whole on admission: returned, admitting no more until then."""
        while self.waiting and len(self.running) < self.slots and not any(map(self._fills, self.running.values())):
            index = self.waiting[0]
            w, done = self.work[index], self.done[index]
            if self.window_pages is not None and self.windows_reserved + w.window > self.window_pages:
                return None
            tokens = [*w.prompt, *done.tokens]  # a preempted request recomputes what it generated
            if w.compressed:  # what it generated is fed after the prefill: as a chunk, or token by token
                self.pool.admit(index)
                hit = self.pool.admit(prefix_key(index), w.prompt, w.cacheable) if w.cacheable else 0
                need = w.kept + (0 if w.stepwise else len(done.tokens))
            else:
                hit = self.pool.admit(index, tokens if self.prefix_cache else None)  # full pages cached
                need = len(tokens) - hit
            try:
                self.pool.reserve(index, need)
            except PoolExhausted:
                self.pool.release(index)
                if w.cacheable:
                    self.pool.release(prefix_key(index))
                return None
            self.waiting.popleft()
            self.stats.cached_tokens += hit
            if w.compressed:
                self.running[index] = seq = Sequence(index, tokens, done, at=0, fill=len(tokens))
                return Prefill(seq, hit)
            self.running[index] = Sequence(index, tokens, done, at=hit, fill=len(tokens))
        return None

    @property
    def windows_reserved(self) -> int:
        """Window-pool pages reserved by the running requests."""
        return sum(self.work[i].window for i in self.running)

    def _replays(self, s: Sequence) -> bool:
        """Whether `s` re-feeds what it generated before a preemption one decode step at a time (`stepwise`:
        its pages must see each token as they saw it)."""
        w = self.work[s.index]
        return s.pending > 1 and w.stepwise and s.at >= len(w.prompt)

    def _fills(self, s: Sequence) -> bool:
        """Whether `s` has prompt (or recomputed) tokens to feed in chunks: a stepwise request its
        uncompressed prompt's alone, to its last token."""
        w = self.work[s.index]
        return s.pending > 1 and not w.stepwise or (w.stepwise and s.at < len(w.prompt))

    def _grow(self, rows: list[Sequence]) -> list[tuple[int, int]]:
        """A page for each decode row's token, preempting the newest requests while short (a prompt
        being prefilled included: its pages are released and it is recomputed later). Returns the
        page copies the reservations need."""
        copies = []
        for s in rows:
            while s.index in self.running:
                try:
                    copies += self.pool.reserve(s.index, 1)
                    break
                except PoolExhausted:
                    victim = max(self.running.values(), key=lambda v: v.index)
                    self.pool.release(victim.index)
                    del self.running[victim.index]
                    victim.done.preempted += 1
                    self.stats.preemptions += 1
                    self.waiting.appendleft(victim.index)
        return copies

    def _greedy_stops(self, rows: list[Sequence], copies: list) -> list[int]:
        """Steps each row may run in one multi-step call, with the pages for them reserved (their copies
        added to `copies`), when there are several to run, every row decodes greedily and the pool holds
        the pages for them all; else [] (what was reserved stays with its rows, which fill it later)."""
        stops = [self.work[s.index].max_new_tokens - len(s.done.tokens) for s in rows]
        if self.decode_steps == 1 or not rows or max(stops) < 2 or not all(self.work[s.index].greedy for s in rows):
            return []
        if any(map(self._replays, rows)):  # a replayed token is fed, not picked
            return []
        stops = [min(n, self.decode_steps) for n in stops]
        try:
            for s, n in zip(rows, stops):
                cap = self.work[s.index].cap  # eviction in the call keeps a row within its cap
                copies += self.pool.reserve(s.index, n if cap is None else min(n, cap - self.pool.lengths[s.index]))
        except PoolExhausted:
            return []
        return stops

    # --- what the device did ----------------------------------------------------------------------
    def prefilled(self, seq: Sequence, cached: int = 0) -> bool:
        """`seq`'s compressed prompt is in its pages, its first `cached` tokens read from the prefix cache
        (`Prefill.cached`); True when its next token is to be picked (from the prefill's logits: nothing
        was generated before a preemption)."""
        self.stats.prefill_tokens += len(self.work[seq.index].prompt) - cached
        self.pool.advance(seq.index, self.work[seq.index].kept)
        seq.at = len(self.work[seq.index].prompt)
        return seq.pending == 0

    def fed(self, seq: Sequence, n: int, held: int | None = None) -> bool:
        """n more of `seq`'s pending tokens are in its pages, which now hold `held` slots when eviction
        while decoding compacted them (the pages past them are freed); True when it has none left, so its
        next token is to be picked (and reported with `picked`)."""
        if held is None:
            self.pool.advance(seq.index, n)
        else:
            self.pool.truncate(seq.index, held)
        self.stats.prefill_tokens += max(0, min(seq.at + n, seq.fill) - seq.at)
        seq.at += n
        length, size = self.pool.lengths[seq.index], self.pool.page_size
        if self.prefix_cache and not self.work[seq.index].compressed and length // size > (length - n) // size:
            self.pool.register(seq.index, seq.tokens)  # every page once it fills, generated ones too (vLLM V1)
        return seq.pending == 0

    def picked(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        """`seq` generated `token` (`top`: the likeliest tokens there, when its request asks); it retires
        (its pages freed) when that ends it."""
        seq.done.tokens.append(token)
        seq.done.logprobs.append(logprob)
        if top is not None:
            seq.done.top.append(top)
        seq.tokens.append(token)
        w, out = self.work[seq.index], seq.done.tokens
        ended = (
            "stop"
            if w.eos_id is not None and out[-1] == w.eos_id
            else "length"
            if len(out) >= w.max_new_tokens
            else None
        )
        if ended:
            seq.done.finish = ended
            self.pool.release(seq.index)
            del self.running[seq.index]

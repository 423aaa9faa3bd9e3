"""The engine's scheduler without a model: a stand-in device writes each fed token into the pages the
plan names and picks the next token from what those pages hold, so a wrong prefix hit, a missed
copy-on-write or a page freed too early changes the tokens. Every request must get what it gets alone."""

import numpy as np
import pytest

from kvjax.config import ConfigError
from kvjax.page_pool import PagePool
from kvjax.scheduler import Prefill, Scheduler, Work

PROMPT_LENGTHS, NEW = (5, 17, 3, 11, 9), (6, 3, 8, 2, 5)


class Device:
    """Pages as lists of tokens; the "model" reads a sequence's pages and hashes them to its next token."""

    def __init__(self, pool: PagePool):
        self.pool, self.pages, self.calls = pool, {}, 0

    def write(self, seq, tokens) -> None:
        size, table, at = self.pool.page_size, self.pool.tables[seq.index], self.pool.lengths[seq.index]
        for i, t in enumerate(tokens):
            self.pages.setdefault(table[(at + i) // size], [None] * size)[(at + i) % size] = t

    def token(self, seq) -> int:
        size, table = self.pool.page_size, self.pool.tables[seq.index]
        held = [self.pages[table[p // size]][p % size] for p in range(self.pool.lengths[seq.index])]
        return sum((i + 1) * t for i, t in enumerate(held)) % 97

    def copy(self, copies) -> None:
        for src, dst in copies:
            self.pages[dst] = list(self.pages[src])

    def run(self, sched: Scheduler, work: list[Work], watch=None):
        done = sched.start(work)
        while (plan := sched.next()) is not None:
            if watch:
                watch(plan)
            self.calls += 1
            if isinstance(plan, Prefill):  # a stand-in compression: keep the prompt's last `kept` tokens
                self.write(plan.seq, work[plan.seq.index].prompt[-work[plan.seq.index].kept :])
                if sched.prefilled(plan.seq):
                    sched.picked(plan.seq, self.token(plan.seq), 0.0)
                continue
            self.copy(plan.copies)
            if plan.greedy_steps:
                for step in range(plan.greedy_steps):
                    for seq, stop in zip(plan.rows, plan.stops):
                        if step < stop and seq.index in sched.running:
                            self.write(seq, [seq.tokens[seq.at]])
                            if sched.fed(seq, 1):
                                sched.picked(seq, self.token(seq), 0.0)
                continue
            fed = [(seq, [seq.tokens[seq.at]]) for seq in plan.rows]
            fed += [(plan.filling, plan.chunk)] if plan.filling else []
            for seq, tokens in fed:
                self.write(seq, tokens)
                if sched.fed(seq, len(tokens)):
                    sched.picked(seq, self.token(seq), 0.0)
        return [d.tokens for d in done]


def _work(eos=None, kept=None):
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(1, 97, 12)]  # 3 pages of 4 that some prompts share
    out = []
    for i, (n, new) in enumerate(zip(PROMPT_LENGTHS, NEW)):
        prompt = (shared if i % 2 else []) + [int(t) for t in rng.integers(1, 97, n)]
        out.append(Work(tuple(prompt), new, eos, kept=None if kept is None else max(1, len(prompt) // kept)))
    return out


def _serve(work, n_pages=40, slots=5, chunk=4, decode_steps=1, prefix_cache=True, watch=None):
    pool = PagePool(n_pages, 4)
    sched = Scheduler(pool, slots=slots, chunk=chunk, decode_steps=decode_steps, prefix_cache=prefix_cache)
    sched.check(work, width=n_pages)
    tokens = Device(pool).run(sched, work, watch)
    assert pool.used_pages == 0  # every page came back
    return tokens, sched


def _alone(work):
    return [_serve([w])[0][0] for w in work]


@pytest.mark.parametrize(
    "n_pages, slots, chunk, decode_steps", [(40, 5, 4, 1), (40, 3, 32, 4), (10, 4, 4, 1), (9, 5, 2, 3)]
)
def test_every_request_gets_what_it_gets_alone(n_pages, slots, chunk, decode_steps):
    work = _work()
    seen = []

    def watch(plan):
        assert len(plan.rows) + (plan.filling is not None) <= slots and len(plan.chunk) <= chunk
        seen.append(plan)

    tokens, sched = _serve(work, n_pages, slots, chunk, decode_steps, watch=watch)
    assert tokens == _alone(work) and [len(t) for t in tokens] == list(NEW)
    assert sched.stats.cached_tokens > 0  # the shared 12-token prefix is reused
    assert sched.stats.prefill_tokens + sched.stats.cached_tokens >= sum(len(w.prompt) for w in work)
    assert any(p.greedy_steps for p in seen) == (decode_steps > 1)
    if n_pages == 10:  # requests 0-2 run (3 and 4 wait for pages) when a page runs short: the newest, 2, yields
        assert [d.preempted for d in sched.done] == [0, 0, 1, 0, 0]
    assert (sched.stats.preemptions > 0) == (n_pages < 40)


def test_an_end_token_retires_a_request_and_frees_its_pages():
    free = _alone(_work())
    eos = free[2][4]  # request 2's fifth token (of 8)
    tokens, _ = _serve(_work(eos=eos), decode_steps=4)
    for got, want in zip(tokens, free):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    assert len(tokens[2]) <= 5


def test_compressed_prompts_are_prefilled_whole_and_take_the_pages_they_keep():
    """A compressed request is admitted with pages for what it keeps and prefilled whole (one Prefill
    plan); with 7 usable pages some are preempted, recomputed from their prompts, and end the same."""
    work = _work(kept=2)
    prefills = []
    tokens, sched = _serve(work, n_pages=8, slots=4, watch=lambda p: isinstance(p, Prefill) and prefills.append(p))
    assert tokens == _alone(work) and sched.stats.preemptions > 0
    assert len(prefills) == len(work) + sched.stats.preemptions
    assert sched.stats.cached_tokens == 0


def test_requests_it_can_never_serve_are_refused_before_any_step():
    pool = PagePool(5, 4)
    sched = Scheduler(pool, slots=2, chunk=4, decode_steps=1, prefix_cache=True)
    with pytest.raises(ConfigError, match="request 0: 30 tokens need 8 pages; a sequence may hold 4"):
        sched.check([Work(tuple(range(20)), 10)], width=99)
    with pytest.raises(ConfigError, match="request 1: the prompt is empty"):
        sched.check([Work((1,), 1), Work((), 1)], width=4)
    with pytest.raises(ConfigError, match="slots=0"):
        Scheduler(pool, slots=0, chunk=4, decode_steps=1, prefix_cache=True)

"""The server's Prometheus metrics (`GET /metrics`): requests running and waiting, pages used and free,
the K/V bytes a page slot takes under the server's policy and the bytes the running requests hold per
token of theirs (less than a slot's under a policy that evicts, more while pages are partly filled),
tokens generated (a counter and the recent rate), preemptions, prompt tokens and the time to each
request's first token."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RATE_WINDOW = 0.9  # weight of the previous estimate in the tokens/s moving average, per step


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvjax_requests_running", "requests decoding or prefilling", registry=r)
        self.waiting = Gauge("kvjax_requests_waiting", "requests queued for admission", registry=r)
        self.pages_used = Gauge("kvjax_pages_used", "K/V pages holding tokens", registry=r)
        self.pages_free = Gauge("kvjax_pages_free", "K/V pages free", registry=r)
        self.slot_bytes = Gauge(
            "kvjax_kv_bytes_per_slot",
            "bytes one token slot of the pages takes, every layer (policy's layout)",
            registry=r,
        )
        self.per_token = Gauge(
            "kvjax_kv_bytes_per_token",
            "K/V page bytes the running requests hold per token of theirs (prompt and generated)",
            registry=r,
        )
        self.rate = Gauge("kvjax_generation_tokens_per_second", "generated tokens/s, moving average", registry=r)
        self.tokens = Counter("kvjax_generation_tokens", "tokens generated", registry=r)
        self.prompt = Counter("kvjax_prompt_tokens", "prompt tokens submitted", registry=r)
        self.requests = Counter("kvjax_requests", "engine requests submitted", registry=r)
        self.preemptions = Counter("kvjax_preemptions", "requests preempted and recomputed", registry=r)
        self.ttft = Histogram("kvjax_time_to_first_token_seconds", "submission to first token", registry=r)
        self._preempted, self._rate = 0, 0.0
        self.content_type = CONTENT_TYPE_LATEST

    def describe(self, engine) -> None:
        self.slot_bytes.set(engine.page_nbytes() / engine.pool.page_size)
        self.step(engine, 0.0, 0)

    def step(self, engine, seconds: float, tokens: int) -> None:
        """After each engine step (on the engine's thread), which took `seconds` and made `tokens`."""
        scheduler, pool = engine.scheduler, engine.pool
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.pages_used.set(pool.used_pages)
        self.pages_free.set(pool.n_pages - 1 - pool.used_pages)
        tokens = sum(len(seq.tokens) for seq in scheduler.running.values())
        self.per_token.set(pool.used_pages * engine.page_nbytes() / tokens if tokens else 0.0)
        self.preemptions.inc(engine.stats.preemptions - self._preempted)
        self._preempted = engine.stats.preemptions
        self.tokens.inc(tokens)
        if seconds > 0:
            self._rate = RATE_WINDOW * self._rate + (1 - RATE_WINDOW) * tokens / seconds
            self.rate.set(self._rate)

    def submitted(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

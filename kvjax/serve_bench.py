"""`kvjax serve-bench`: serving throughput at a fixed KV memory budget, on a synthetic workload, in one run.

Servers compared at the same bytes of K/V memory:
- **static batches** (`Generator`): requests in arrival order, `rows` at a time, each batch decoded to
  its longest output; without paging every row must reserve the workload's longest prompt plus its
  longest output, so rows = budget / the bytes of one row's caches at that reservation (sliding-window
  rings capped at their window, as `Generator` allocates them).
- **engine** (`kvjax.Engine`): paged memory, continuous batching, chunked prefill mixed into the decode
  steps, prefix cache; the budget buys pages.
- **engine + policy** for each `--policy` entry (e.g. `snapkv:0.5`, `int:8`): the same budget buys
  pages of the policy's layout (int8 pages are smaller, so there are more), and compressed prompts take
  fewer of them, so more requests run at once.

On a model with sliding-window layers (Gemma 3) the engine's local layers hold only their windows' pages
(`kvjax.window_pages`), as a static row's rings hold only their window; recurrent layers hold a state per
running request either way.

Prompt and output lengths are drawn uniformly from their ranges (numpy seed `seed`); an optional shared
prefix starts every prompt; every request decodes greedily to its own length. Prompts are random tokens, or
passages of a text (`text`: a corpus's validation tokens, `kvjax serve-bench --prompts kjv`) at random
offsets, so that the quality column measures the policies on natural text (speed hardly depends on which:
every request decodes to its length). Each server serves the whole workload once untimed (all its
compiles) and is timed on the second pass, so neither side's figures include compiling. Beside each
policy, its quality cost on what it served: KL(full || policy) of the next-token distributions along every
request's served continuation (`kvjax.quality`; `kl=False` skips it). Without a memory budget, the
servers get what static batches need to hold a quarter of the requests at once (`default_memory`): tight
enough that paging has something to win.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from kvjax import memory
from kvjax.config import ConfigError, DecodingConfig
from kvjax.engine import Engine, Request
from kvjax.generate import Generator
from kvjax.quality import continuation_kl
from kvjax.report import format_table


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int = 32
    prompt: tuple[int, int] = (32, 256)
    new: tuple[int, int] = (8, 128)
    shared_prefix: int = 0
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt", "new"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"--{name} {lo} {hi}: need 1 <= low <= high")
        if self.requests < 1 or self.shared_prefix < 0:
            raise ConfigError(f"--requests={self.requests} must be >= 1 and --shared-prefix={self.shared_prefix} >= 0")

    def sample(self, vocab: int, text: np.ndarray | None = None) -> list[Request]:
        """The requests: random tokens below `vocab`, or with `text` (a token stream) passages of it, the
        shared prefix one passage and each request's own part another, at offsets drawn uniformly."""
        if text is not None and len(text) < self.shared_prefix + self.prompt[1]:
            raise ConfigError(
                f"--prompts: the text has {len(text):,} tokens, fewer than a prompt of {self.shared_prefix} "
                f"shared + {self.prompt[1]} of its own; give a longer text or shorter prompts"
            )
        rng = np.random.default_rng(self.seed)

        def tokens(n) -> list[int]:
            if text is None:
                return [int(t) for t in rng.integers(0, vocab, n)]
            start = int(rng.integers(0, len(text) - n + 1))
            return [int(t) for t in text[start : start + n]]

        shared = tokens(self.shared_prefix)
        out = []
        for _ in range(self.requests):
            own = tokens(rng.integers(self.prompt[0], self.prompt[1] + 1))
            new = int(rng.integers(self.new[0], self.new[1] + 1))
            out.append(Request(tuple(shared + own), DecodingConfig(max_new_tokens=new)))
        return out


# Named workloads (prompt range, output range, shared prefix): a chat service (a 128-token system prompt
# every request shares, then a turn), long documents to answer briefly, short prompts generating long
# (reasoning traces: 1-2k new tokens).
WORKLOADS = {
    "chat": dict(prompt=(32, 256), new=(32, 256), shared_prefix=128),
    "long-prompt": dict(prompt=(1024, 2048), new=(8, 64), shared_prefix=0),
    "long-generation": dict(prompt=(16, 64), new=(1024, 2048), shared_prefix=0),
}
STATIC_SHARE = 4  # the default budget holds 1/STATIC_SHARE of the requests as static rows


def reservation(requests: list[Request]) -> int:
    """Tokens a static row reserves: the longest prompt plus the longest output of the workload."""
    return max(len(r.prompt) for r in requests) + max(r.decoding.max_new_tokens for r in requests)


def default_memory(cfg, workload: Workload, text: np.ndarray | None = None) -> float:
    """MiB of K/V for `ceil(requests / STATIC_SHARE)` static rows of the workload's reservation."""
    rows = -(-workload.requests // STATIC_SHARE)
    return rows * memory.cache_bytes(cfg, reservation(workload.sample(cfg.vocab_size, text))) / 2**20


def probe(model, page_size: int, policy: str | None, **engine) -> Engine:
    """A one-slot engine of the model, page size and policy (and `engine` arguments: the chunk and decode
    steps size the window pages' reservations), for its page and state bytes and `Engine.fit`."""
    return Engine(model, n_pages=2, page_size=page_size, slots=1, policy=policy, **engine)


def _timed(name: str, serve: Callable[[], None], log: Callable[[str], None]) -> float:
    """Seconds `serve` takes on its second call; the first compiles everything it needs (an engine's chunk
    and step buckets and a policy's prefill per prompt bucket; a static server's prompt buckets)."""
    start = time.perf_counter()
    serve()
    log(f"{name}: first pass (compiles) {time.perf_counter() - start:.1f} s; timing the second")
    start = time.perf_counter()
    serve()
    seconds = time.perf_counter() - start
    log(f"{name}: {seconds:.1f} s")
    return seconds


def _static(model, requests, rows: int, capacity: int) -> Callable[[], None]:
    """Static batches: `rows` requests at a time, each batch decoded to its longest output."""
    gen = Generator(model, capacity=capacity)

    def serve():
        for i in range(0, len(requests), rows):
            batch = requests[i : i + rows]
            longest = max(r.decoding.max_new_tokens for r in batch)
            jax.block_until_ready(gen([list(r.prompt) for r in batch], DecodingConfig(max_new_tokens=longest)).tokens)

    return serve


def _engine(engine: Engine, requests, served: list) -> Callable[[], None]:
    """Serve the workload from a fresh engine state; `served` keeps the last pass's completions."""

    def serve():
        engine.reset()
        served[:] = engine.run(requests)

    return serve


def serve_bench(
    model,
    workload: Workload,
    *,
    memory_mib: float,
    page_size: int = 16,
    slots: int = 16,
    chunk: int = 128,
    decode_steps: int = 8,
    policies: tuple[str, ...] = (),
    log: Callable[[str], None] = lambda line: None,
    http: int | None = None,
    tokenizer=None,
    kl: bool = True,
    text: np.ndarray | None = None,
    text_name: str = "random tokens",
    calibration: np.ndarray | None = None,
) -> dict:
    """Run every server on the workload at `memory_mib` MiB of K/V and return the figures (see the module
    docstring); a budget too small for the longest request, or a policy budget a prompt cannot meet, is
    a ConfigError before any compute. `log` hears each pass as it ends. With `http` (a concurrency),
    each engine also serves the workload through its thread and through `kvjax serve`'s HTTP app at that
    many streams at once (`kvjax.serve.bench`; `tokenizer` decodes the text the server sends). With `kl`,
    each policy's served continuations are scored against the full cache (`kvjax.quality`). With `text`
    (tokens of the text named `text_name`), prompts are passages of it. `calibration`: tokens a policy learns
    from (Palu's bases)."""
    cfg = model.config
    requests = workload.sample(cfg.vocab_size, text)
    if text is not None and (top := max(max(r.prompt) for r in requests)) >= cfg.vocab_size:
        raise ConfigError(f"--prompts {text_name}: token {top} is past the model's vocab_size={cfg.vocab_size}")
    budget = int(memory_mib * 2**20)
    longest = max(len(r.prompt) + r.decoding.max_new_tokens for r in requests)
    reserve = reservation(requests)
    row_bytes = memory.cache_bytes(cfg, reserve)  # a static row's caches (sliding-window rings capped)
    rows = budget // row_bytes
    if rows < 1:
        raise ConfigError(
            f"--memory-mib={memory_mib:g}: {budget:,} bytes hold no static row of {reserve} tokens; the least "
            f"that holds one is {row_bytes / 2**20:.3g} MiB (the default, {default_memory(cfg, workload, text):.3g}, "
            f"holds {-(-workload.requests // STATIC_SHARE)})"
        )
    engines = {}
    for policy in (None, *policies):  # each layout's pages in the budget; every request checked before compute
        sized = probe(model, page_size, policy, chunk=chunk, decode_steps=decode_steps, calibration=calibration)
        fitted, n_pages, window_pool = sized.fit(budget, slots, longest)
        engines[policy] = Engine(
            model,
            n_pages=n_pages,
            page_size=page_size,
            slots=fitted,
            chunk=chunk,
            max_tokens=longest,
            policy=policy,
            decode_steps=decode_steps,
            window_pool=window_pool,
            calibration=calibration,
        )
        engines[policy].check(requests)
    new_tokens = sum(r.decoding.max_new_tokens for r in requests)
    out = {
        "model": cfg.name,
        "kv_bytes_per_token": memory.cache_bytes_per_token(cfg),
        "state_bytes_per_sequence": memory.state_bytes_per_sequence(cfg),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "workload": dataclasses.asdict(workload),
        "prompts": text_name,
        "kv_budget_bytes": budget,
        "new_tokens": new_tokens,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "servers": [],
    }
    static_s = _timed("static batches", _static(model, requests, rows, reserve), log)
    out["servers"].append(
        {
            "server": "static batches",
            "policy": None,
            "seconds": static_s,
            "concurrent": min(rows, len(requests)),  # the largest batch that ran
            "rows_in_memory": rows,
            "tokens_per_s": new_tokens / static_s,
            "requests_per_s": len(requests) / static_s,
            "bytes_allocated": rows * row_bytes,
            "prefill_tokens": out["prompt_tokens"],
        }
    )
    for policy, engine in engines.items():
        served = []
        seconds = _timed("engine" + (f" + {policy}" if policy else ""), _engine(engine, requests, served), log)
        s, pool, per_page = engine.stats, engine.pool, engine.page_nbytes()
        lookups = pool.hits + pool.misses
        out["servers"].append(
            {
                "server": "engine",
                "policy": policy,
                "seconds": seconds,
                "concurrent": s.peak_running,
                "tokens_per_s": new_tokens / seconds,
                "requests_per_s": len(requests) / seconds,
                "pages": pool.n_pages - 1,
                "peak_pages": s.peak_pages,
                "window_pages": None if engine.windows is None else engine.windows.n_pages - 1,
                "page_bytes": per_page,
                "bytes_allocated": engine.nbytes(),
                "peak_bytes_used": s.peak_pages * per_page
                + (engine.fixed_nbytes(s.peak_running) if s.peak_running else 0),
                "prefill_tokens": s.prefill_tokens,
                "cached_tokens": s.cached_tokens,
                "prefix_hit_rate": pool.hits / lookups if lookups else 0.0,
                "steps": s.steps,
                "calls": s.calls,
                "preemptions": s.preemptions,
            }
        )
        if kl and policy:
            start = time.perf_counter()
            prompts, continuations = [r.prompt for r in requests], [c.tokens for c in served]
            cost = continuation_kl(model, prompts, continuations, policy, calibration)
            out["servers"][-1].update(kl_vs_full=cost.kl, kl_max=cost.kl_max, kl_positions=cost.positions)
            took = time.perf_counter() - start
            log(f"engine + {policy}: KL vs full {cost.kl:.4g} over {cost.positions} tokens ({took:.1f} s)")
        if http:
            from kvjax.serve.bench import http_figures

            figures = out["servers"][-1]["http"] = http_figures(engine, tokenizer, requests, http)
            log(f"engine{f' + {policy}' if policy else ''}: in process / HTTP {figures['http_vs_in_process']:.2f}x")
    return out


def render(figures: dict) -> str:
    """The figures as a table, with each server's speed relative to static batching."""
    w = figures["workload"]
    base = figures["servers"][0]["tokens_per_s"]
    rows = []
    for s in figures["servers"]:
        name = s["server"] + (f" + {s['policy']}" if s["policy"] else "")
        pages = f"{s['peak_pages']}/{s['pages']}" if "pages" in s else "-"
        hit = f"{s['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in s else "-"
        rows.append(
            [
                name,
                s["concurrent"],
                f"{s['tokens_per_s']:,.1f}",
                f"{s['tokens_per_s'] / base:.2f}x",
                f"{s['requests_per_s']:.2f}",
                f"{s['seconds']:.1f}",
                f"{s['prefill_tokens']:,}",
                hit,
                pages,
                s.get("preemptions", "-"),
                f"{s['kl_vs_full']:.3g}" if "kl_vs_full" in s else "-",
            ]
        )
    head = (
        f"{figures['model']}: {w['requests']} requests, prompts {w['prompt'][0]}-{w['prompt'][1]} "
        f"{figures.get('prompts', 'random tokens')} "
        f"(+{w['shared_prefix']} shared), outputs {w['new'][0]}-{w['new'][1]}, seed {w['seed']}; K/V budget "
        f"{figures['kv_budget_bytes'] / 2**20:g} MiB ({figures['device']}, jax {figures['jax']})"
    )
    table = format_table(
        [
            "server",
            "concurrent",
            "tokens/s",
            "vs static",
            "requests/s",
            "seconds",
            "prefill tokens",
            "prefix hits",
            "peak pages",
            "preemptions",
            "KL vs full",
        ],
        rows,
    )
    return f"{head}\n{table}" + (_http_table(figures) if any("http" in s for s in figures["servers"]) else "")


def render_models(runs: list[dict]) -> str:
    """Several models' figures at one budget side by side: what each architecture's memory buys."""
    rows = []
    for figures in runs:
        static, engine = figures["servers"][0], figures["servers"][1]
        rows.append(
            [
                figures["model"],
                f"{figures['kv_bytes_per_token']:,}",
                f"{figures['state_bytes_per_sequence']:,}",
                static["concurrent"],
                engine["concurrent"],
                f"{engine['peak_pages']}/{engine['pages']}" if engine["page_bytes"] else "- (no paged layer)",
                f"{static['tokens_per_s']:,.1f}",
                f"{engine['tokens_per_s']:,.1f}",
                f"{engine['tokens_per_s'] / static['tokens_per_s']:.2f}x",
                engine["preemptions"],
            ]
        )
    head = ["model", "KV B/token", "state B/seq", "static rows", "engine concurrent", "peak pages"]
    head += ["static tok/s", "engine tok/s", "engine vs static", "preemptions"]
    return format_table(head, rows)


def _http_table(figures: dict) -> str:
    """Each engine through its thread and through HTTP: tokens/s, time to first token, gaps between chunks."""
    rows = []
    for s in figures["servers"]:
        if "http" not in s:
            continue
        h = s["http"]
        for way in ("in_process", "http"):
            f = h[way]
            rows.append(
                [
                    "engine" + (f" + {s['policy']}" if s["policy"] else ""),
                    way.replace("_", " "),
                    f"{f['tokens_per_s']:,.1f}",
                    f"{f['ttft']['p50_ms']:,.0f} / {f['ttft']['p99_ms']:,.0f}",
                    f"{f['chunk_gap']['p50_ms']:,.0f} / {f['chunk_gap']['p99_ms']:,.0f}",
                    f"{h['http_vs_in_process']:.2f}x" if way == "http" else "",
                ]
            )
    concurrency = next(s["http"]["concurrency"] for s in figures["servers"] if "http" in s)
    table = format_table(
        ["server", "through", "tokens/s", "TTFT p50 / p99 ms", "chunk gap p50 / p99 ms", "in-process / HTTP"], rows
    )
    return f"\n\n{concurrency} streams at once, the same engine through its thread and through HTTP:\n{table}"

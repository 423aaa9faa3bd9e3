"""Serving throughput at a fixed KV memory budget: `kvjax.Engine` (paged memory, continuous batching,
prefix cache) against static batching with `Generator` (each batch reserves prompt + max new tokens
for every row, as a server without paging must), on a synthetic workload, in the same run.

    python scripts/bench_serving.py [--model gqa|RUN|smollm2] [--requests 32] [--prompt 32 256]
        [--new 8 128] [--shared-prefix 0] [--memory-mib 4] [--page-size 16] [--slots 16] [--json OUT]

Prompt and output lengths are drawn uniformly from the given ranges (seed 0); every request decodes
greedily to its own length. A model config name builds a randomly initialised model of that shape
(throughput does not depend on the weights); a run directory or `smollm2` loads one.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from kvjax import DecodingConfig, Engine, Generator, Request, memory
from kvjax.config import load_config
from kvjax.report import format_table


def load(name: str):
    from pathlib import Path

    if (Path("configs/models") / f"{name}.yaml").is_file() or name.endswith(".yaml"):
        from architectures import Decoder

        return Decoder(load_config(name).model, rngs=nnx.Rngs(0))
    from training.loading import load_model

    return load_model(name).model


def workload(args, vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    shared = list(rng.integers(0, vocab, args.shared_prefix))
    out = []
    for _ in range(args.requests):
        prompt = shared + list(rng.integers(0, vocab, rng.integers(args.prompt[0], args.prompt[1] + 1)))
        new = int(rng.integers(args.new[0], args.new[1] + 1))
        out.append(Request(tuple(int(t) for t in prompt), DecodingConfig(max_new_tokens=new)))
    return out


def static_batches(model, requests: list[Request], rows: int, capacity: int) -> float:
    """Seconds to serve `requests` in arrival order, `rows` at a time, each batch run to its longest
    output (Generator pads prompts and decodes until every row is done)."""
    gen = Generator(model, capacity=capacity)
    start = time.perf_counter()
    for i in range(0, len(requests), rows):
        batch = requests[i:i + rows]
        longest = max(r.decoding.max_new_tokens for r in batch)
        jax.block_until_ready(gen([list(r.prompt) for r in batch], DecodingConfig(max_new_tokens=longest)).tokens)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gqa")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--new", type=int, nargs=2, default=[8, 128])
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--memory-mib", type=float, default=4.0, help="KV memory for both servers")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16, help="engine sequence slots")
    parser.add_argument("--chunk", type=int, default=128, help="engine prefill chunk")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    model = load(args.model)
    cfg = model.config
    requests = workload(args, cfg.vocab_size)
    budget = int(args.memory_mib * 2**20)
    longest = max(len(r.prompt) + r.decoding.max_new_tokens for r in requests)
    # A static batch pads every row to its longest prompt and decodes to its longest output: without
    # paging, each row must reserve the longest prompt plus the longest output of the workload.
    reserve = max(len(r.prompt) for r in requests) + max(r.decoding.max_new_tokens for r in requests)
    per_token = memory.cache_bytes_per_token(cfg)
    rows = max(1, budget // (per_token * reserve))
    n_pages = budget // (per_token * args.page_size) + 1  # + the null page
    new_tokens = sum(r.decoding.max_new_tokens for r in requests)

    engine = Engine(model, n_pages=n_pages, page_size=args.page_size, slots=args.slots, chunk=args.chunk,
                    max_tokens=longest)
    engine.run(requests[:2])  # compile
    engine = Engine(model, n_pages=n_pages, page_size=args.page_size, slots=args.slots, chunk=args.chunk,
                    max_tokens=longest)
    start = time.perf_counter()
    engine.run(requests)
    engine_s = time.perf_counter() - start
    static_batches(model, requests[:rows], rows, reserve)  # compile
    static_s = static_batches(model, requests, rows, reserve)

    s = engine.stats
    figures = {
        "model": args.model, "requests": len(requests), "kv_budget_bytes": budget, "new_tokens": new_tokens,
        "engine": {"seconds": engine_s, "tokens_per_s": new_tokens / engine_s, "requests_per_s": len(requests) / engine_s,
                   "pages": n_pages - 1, "peak_pages": s.peak_pages, "steps": s.steps, "prefill_tokens": s.prefill_tokens,
                   "cached_tokens": s.cached_tokens, "preemptions": s.preemptions, "bytes_allocated": engine.nbytes()},
        "static": {"seconds": static_s, "tokens_per_s": new_tokens / static_s, "requests_per_s": len(requests) / static_s,
                   "rows": rows, "capacity": reserve},
    }
    print(f"{args.model}: {len(requests)} requests, prompts {args.prompt}, outputs {args.new}, shared prefix "
          f"{args.shared_prefix}, KV budget {args.memory_mib} MiB ({jax.devices()[0].device_kind}, jax {jax.__version__})")
    print(format_table(
        ["server", "concurrent", "tokens/s", "requests/s", "seconds", "prefill tokens (cached)", "peak pages"],
        [["engine (paged)", args.slots, f"{new_tokens / engine_s:,.1f}", f"{len(requests) / engine_s:.2f}",
          f"{engine_s:.1f}", f"{s.prefill_tokens:,} ({s.cached_tokens:,})", f"{s.peak_pages}/{n_pages - 1}"],
         ["static batches", rows, f"{new_tokens / static_s:,.1f}", f"{len(requests) / static_s:.2f}", f"{static_s:.1f}",
          f"{sum(len(r.prompt) for r in requests):,} (0)", "-"]]))
    print(f"engine / static tokens/s: {static_s / engine_s:.2f}x; preemptions {s.preemptions}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()

"""What HTTP costs: one workload served by the same engine twice at the same concurrency, once through
the engine's thread directly (`Worker`, as `kvjax serve` drives it) and once through the HTTP server
(`kvjax serve`'s app under uvicorn on the loopback, streamed SSE requests of token ids); tokens/s of
each, their ratio, and the time to first token and between streamed chunks (p50, p99). A chunk may carry
several tokens (greedy rows decode several steps a call), so the gap between chunks is the latency a
client sees, not a per-token figure."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np

from kvjax.engine import Engine, Request
from kvjax.serve.worker import Listener, Worker


def percentiles(values: list[float]) -> dict:
    """p50 and p99 in milliseconds (NaN for none)."""
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    return {"p50_ms": 1e3 * float(np.percentile(values, 50)), "p99_ms": 1e3 * float(np.percentile(values, 99))}


async def _drive(requests: list[Request], concurrency: int, one) -> dict:
    """Every request through `one(request) -> [(seconds since its start, tokens)]` with at most `concurrency`
    at once; tokens/s over the whole run, time to first token and gaps between chunks."""
    gate = asyncio.Semaphore(concurrency)
    firsts, gaps, tokens = [], [], 0

    async def run(request):
        nonlocal tokens
        async with gate:
            events = await one(request)
        times = [t for t, n in events if n]
        tokens += sum(n for _, n in events)
        if times:
            firsts.append(times[0])
            gaps.extend(np.diff(times).tolist())

    start = time.perf_counter()
    await asyncio.gather(*(run(r) for r in requests))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft": percentiles(firsts), "chunk_gap": percentiles(gaps)}  # fmt: skip


def in_process(engine: Engine, requests: list[Request], concurrency: int) -> dict:
    """The workload through the engine's thread, no HTTP: the second of two passes (the first compiles
    the step shapes this arrival pattern makes)."""
    worker = Worker(engine)

    async def one(request):
        loop, events, out = asyncio.get_running_loop(), asyncio.Queue(), []
        start = time.perf_counter()
        await worker.submit(request, Listener(loop, events))
        while True:
            _, event = await events.get()
            out.append((time.perf_counter() - start, len(event.ids)))
            if event.finish is not None:
                return out

    try:
        asyncio.run(_drive(requests, concurrency, one))
        return asyncio.run(_drive(requests, concurrency, one))
    finally:
        worker.stop()


def over_http(engine: Engine, tokenizer, requests: list[Request], concurrency: int) -> dict:
    """The workload through `kvjax serve`'s app on a loopback port: each request a streamed completion of
    its prompt's token ids (`ignore_eos`, so that every token asked for is generated, as in process), its
    tokens counted from the chunks' log-probabilities; the second of two passes."""
    import uvicorn

    from kvjax.serve.app import Served, create_app

    longest = max(len(r.prompt) + r.decoding.max_new_tokens for r in requests)
    app = create_app(lambda: Served(engine, tokenizer, "bench", False, longest + 1, None), max_waiting=len(requests))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while app.state.server.state == "loading" or not server.started:
        time.sleep(0.05)

    async def one(request):
        body = {"prompt": list(request.prompt), "max_tokens": request.decoding.max_new_tokens, "temperature": 0,
                "stream": True, "logprobs": 0, "ignore_eos": True}  # fmt: skip
        return await _stream(port, body)

    try:
        asyncio.run(_drive(requests, concurrency, one))
        return asyncio.run(_drive(requests, concurrency, one))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        app.state.server.close()


async def _stream(port: int, body: dict) -> list[tuple[float, int]]:
    """One streamed completion over a plain HTTP/1.1 connection: (seconds since sending, tokens) per chunk."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    out = []
    async for line in reader:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            logprobs = chunk["choices"][0]["logprobs"] or {"tokens": []}
            out.append((time.perf_counter() - start, len(logprobs["tokens"])))
    writer.close()
    return out


def http_figures(engine: Engine, tokenizer, requests: list[Request], concurrency: int) -> dict:
    """The workload in process and over HTTP on `engine` (each timed on its second pass)."""
    engine.reset()
    engine.warm()  # every step shape: an arrival pattern met first over HTTP compiles nothing then
    direct = in_process(engine, requests, concurrency)
    engine.reset()
    http = over_http(engine, tokenizer, requests, concurrency)
    return {"concurrency": concurrency, "in_process": direct, "http": http,
            "http_vs_in_process": direct["tokens_per_s"] / http["tokens_per_s"]}  # fmt: skip

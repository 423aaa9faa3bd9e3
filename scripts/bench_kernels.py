"""Attention kernels against the XLA path, per context length, in one run: time, and the achieved memory
bandwidth (decode: the K/V bytes read per second) or FLOP/s (prefill, causal: 2 * 2 * T^2/2 * H per
head). Quantized decode (`--quant int:8 kivi:2`): the fused dequantize-attend kernel against XLA
dequantizing the cache then attending, both reported against the bytes the cache holds.

On a TPU or GPU both the Pallas kernels (`impl=pallas`) and XLA are timed. On a CPU Pallas only
interprets (correct, not fast), so the script says so and times the XLA path alone.

    python scripts/bench_kernels.py [--contexts 1024 4096 16384 32768] [--batch 8] [--dtype bfloat16]
                                    [--quant int:8 kivi:2]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.compress.policy import parse_stage
from kvjax.ops import attention
from kvjax.quant import QuantKVCache
from kvjax.report import format_table

SHAPE = dict(N=9, K=3, H=64)  # SmolLM2-135M's attention


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def decode_inputs(batch: int, context: int, dtype):
    N, K, H = SHAPE["N"], SHAPE["K"], SHAPE["H"]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, 1, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, K, context, H)), dtype) for _ in range(2))
    k_pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))
    return q, k, v, jnp.full((batch, 1), context - 1, jnp.int32), k_pos


def quantized_cache(policy: str, k, v, dtype) -> QuantKVCache:
    """k, v `[B,K,S,H]` written into a quantized cache of S slots (`policy`: an int or kivi encoder)."""
    B, K, S, H = k.shape
    spec = parse_stage(policy).quant_spec
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cache = QuantKVCache.init(spec, B, S, K, H, dtype)
    return jax.jit(lambda c, k, v: c.update(k.swapaxes(1, 2), v.swapaxes(1, 2), pos)[0])(cache, k, v)


def quant_decode(impl: str):
    """A decode step's attention over a quantized cache: fused over the codes (pallas) or XLA over the
    dequantized copy."""

    def step(q, cache, q_pos):
        k, v = cache.dequantized()
        quant = cache.stored() if impl == "pallas" else None
        return attention(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, cache.pos, impl=impl, quant=quant)

    return jax.jit(step)


def prefill_inputs(batch: int, tokens: int, dtype):
    N, K, H = SHAPE["N"], SHAPE["K"], SHAPE["H"]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(batch, tokens, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(batch, K, tokens, H)), dtype) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    return q, k, v, pos, pos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefill-batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quant", nargs="*", default=["int:8", "kivi:2"], help="quantized caches to decode over")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    kernels = jax.default_backend() in ("tpu", "gpu")
    impls = ("xla", "pallas") if kernels else ("xla",)
    print(
        f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, {args.dtype}, SmolLM2 attention "
        f"(N={SHAPE['N']}, K={SHAPE['K']}, H={SHAPE['H']})"
    )
    if not kernels:
        print("CPU: Pallas kernels only run in interpret mode here (for correctness); timing the XLA path only.")
    rows = []
    N, H = SHAPE["N"], SHAPE["H"]
    for context in args.contexts:
        q, k, v, q_pos, k_pos = decode_inputs(args.batch, context, dtype)
        kv_bytes = k.nbytes + v.nbytes
        times = {}
        for impl in impls:
            step = jax.jit(functools.partial(attention, impl=impl))
            times[impl] = median_seconds(lambda: step(q, k, v, q_pos, k_pos), args.repeats)
        row = ["decode", context, args.batch]
        row += [f"{times[i] * 1e3:.3f} ms ({kv_bytes / times[i] / 1e9:.1f} GB/s)" for i in impls]
        rows.append(row + ([f"{times['xla'] / times['pallas']:.2f}x"] if kernels else []))
        for policy in args.quant:
            cache = quantized_cache(policy, k, v, dtype)
            steps = {i: quant_decode(i) for i in impls}
            times = {i: median_seconds(lambda: steps[i](q, cache, q_pos), args.repeats) for i in impls}
            row = [f"decode {policy}", context, args.batch]
            row += [f"{times[i] * 1e3:.3f} ms ({cache.nbytes() / times[i] / 1e9:.1f} GB/s)" for i in impls]
            rows.append(row + ([f"{times['xla'] / times['pallas']:.2f}x"] if kernels else []))
    for tokens in args.contexts:
        q, k, v, q_pos, k_pos = prefill_inputs(args.prefill_batch, tokens, dtype)
        flops = 2 * 2 * args.prefill_batch * N * H * tokens * tokens / 2  # QK^T and PV, causal half
        times = {}
        for impl in impls:
            fwd = jax.jit(functools.partial(attention, impl=impl))
            try:
                times[impl] = median_seconds(lambda: fwd(q, k, v, q_pos, k_pos), max(2, args.repeats // 3))
            except Exception as e:  # e.g. XLA's [T, S] logits not fitting in memory at long contexts
                times[impl] = float("nan")
                print(f"prefill {tokens} {impl}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        row = ["prefill", tokens, args.prefill_batch]
        row += [f"{times[i] * 1e3:.2f} ms ({flops / times[i] / 1e12:.2f} TFLOP/s)" for i in impls]
        rows.append(row + ([f"{times['xla'] / times['pallas']:.2f}x"] if kernels else []))
    headers = ["op", "tokens", "batch", *(f"{i}" for i in impls)] + (["pallas speedup"] if kernels else [])
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()

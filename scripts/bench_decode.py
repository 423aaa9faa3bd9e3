"""Decode step time of a ~10M-parameter GQA model against the memory-bandwidth roofline, in one run.

A decode step must read every parameter and the whole cache once, so its floor is
(param bytes + cache bytes) / read bandwidth. The bandwidth is measured here, in the same process, with
jitted reductions over a buffer larger than the last-level cache, so the ratio is robust to a noisy
machine.

Two more rows say where the time goes: the same model's step with a 128-slot cache (weights-bound), and
the attention op alone, chained over the layers' real caches (cache-bound), each against its own floor.

    python scripts/bench_decode.py [--batch 8] [--context 2048] [--steps 64]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import DecodingConfig, Generator
from kvjax.architectures import Decoder
from kvjax.cache import caches_nbytes
from kvjax.config import AttentionConfig, ModelConfig
from kvjax.ops import attention
from kvjax.report import format_bytes, format_table

BENCH_MODEL = ModelConfig(
    name="gqa-10m",
    d_model=384,
    n_layers=6,
    ffn_dim=1024,
    attention=AttentionConfig(n_heads=6, n_kv_heads=2, head_dim=64),
)


def best_of(fn, repeats: int) -> float:
    """Fastest wall time of `repeats` calls (the least disturbed by other work on the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second of the faster of two jitted streaming reads of an n_bytes fp32 buffer: one sum,
    and 8 independent sums over eighths (which XLA may spread over cores). n_bytes must exceed the
    last-level cache (480 MiB on the CI machine) so that this measures memory, not cache."""
    whole = jnp.ones((n_bytes // 4,), jnp.float32)
    parts = list(whole.reshape(8, -1))
    one = jax.jit(jnp.sum)
    split = jax.jit(lambda *ps: [p.sum() for p in ps])
    jax.block_until_ready((one(whole), split(*parts)))
    return n_bytes / min(
        best_of(lambda: one(whole).block_until_ready(), repeats),
        best_of(lambda: jax.block_until_ready(split(*parts)), repeats),
    )


def decode_step_time(gen: Generator, caches, logits, lengths, steps: int, repeats: int) -> tuple[float, tuple]:
    """Seconds per decode step after a prefill (its caches, next-token logits and prompt lengths): the loop
    generating 1 + steps tokens minus the loop generating 1 (so the first sample is excluded), each run on
    a fresh copy of the caches, since the loop consumes (donates) them. Returns the step time and the
    final caches."""

    def run(n_new):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, caches))
        start = time.perf_counter()
        out = gen.decode(fresh, logits, lengths, DecodingConfig(max_new_tokens=n_new), jax.random.key(0))
        jax.block_until_ready(out.caches)
        return time.perf_counter() - start, out.caches

    for n in (1, 1 + steps):
        run(n)  # compile
    base = min(run(1)[0] for _ in range(repeats))
    loop = min(run(1 + steps)[0] for _ in range(repeats))
    return (loop - base) / steps, run(1 + steps)[1]


def measure_step(model, batch: int, context: int, steps: int, repeats: int) -> tuple[float, tuple]:
    """Decode step time with a `context`-slot cache filled to the brim, and the final caches."""
    gen = Generator(model, capacity=context)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, context - steps - 1))
    tokens, lengths = gen.pad(prompts.tolist(), steps + 1)
    logits, caches = gen.prefill(tokens, lengths)
    return decode_step_time(gen, caches, logits, lengths, steps, repeats)


def attention_time(caches, n_heads: int, repeats: int) -> float:
    """Seconds for one decode query per row to attend over every layer's cache in turn (each layer's
    output is the next one's query; a barrier stops XLA fusing one layer's value product with the next
    layer's logits, which a real layer's projections also prevent), the attention op alone."""
    B, K, S, H = caches[0].k.shape
    q_pos = jnp.full((B, 1), S, jnp.int32)

    @jax.jit
    def chain(q, caches):
        for c in caches:
            q = jax.lax.optimization_barrier(attention(q, c.k, c.v, q_pos, c.pos))
        return q

    q = jnp.ones((B, 1, n_heads, H), caches[0].k.dtype)
    jax.block_until_ready(chain(q, caches))
    return best_of(lambda: jax.block_until_ready(chain(q, caches)), repeats * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="cache capacity (tokens per row)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = Decoder(BENCH_MODEL, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    step, caches = measure_step(model, args.batch, args.context, args.steps, args.repeats)
    cache_bytes = caches_nbytes(caches)
    small_step, small_caches = measure_step(model, args.batch, 128, 32, args.repeats)
    attn = attention_time(caches, BENCH_MODEL.attention.n_heads, args.repeats)
    bandwidth = read_bandwidth()
    roofline = (param_bytes + cache_bytes) / bandwidth
    small_roofline = (param_bytes + caches_nbytes(small_caches)) / bandwidth
    print(
        f"model {BENCH_MODEL.name}: {n_params / 1e6:.2f}M params, batch {args.batch}, cache capacity "
        f"{args.context}, fp32, {jax.device_count()} {jax.devices()[0].platform} device(s)"
    )
    print(
        format_table(
            ["quantity", "value"],
            [
                ["param bytes", format_bytes(param_bytes)],
                ["cache bytes (all layers, batch)", format_bytes(cache_bytes)],
                ["read bandwidth (measured)", f"{bandwidth / 1e9:.1f} GB/s"],
                ["roofline step time", f"{roofline * 1e3:.2f} ms"],
                ["decode step time", f"{step * 1e3:.2f} ms"],
                ["step / roofline", f"{step / roofline:.2f}x"],
                ["decode tokens/s (batch)", f"{args.batch / step:,.0f}"],
                [
                    "weights-bound step (128-slot cache)",
                    f"{small_step * 1e3:.2f} ms ({small_step / small_roofline:.2f}x)",
                ],
                ["attention op alone, all layers", f"{attn * 1e3:.2f} ms ({attn / (cache_bytes / bandwidth):.2f}x)"],
            ],
        )
    )


if __name__ == "__main__":
    main()

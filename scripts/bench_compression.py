"""Decode step time with token-compressed caches against the full cache, at a long context, in one run.

Decode time depends on the cache's size and layout, not on which tokens were kept, so the caches are
filled with random entries at positions 0..context-1 (an 8k-token prefill of SmolLM2 would dominate the
run) and compressed by policies that need no attention observation but produce each layout:
`streaming` (positions shared by the KV heads: also TOVA's layout), `keynorm` (positions per head:
also SnapKV's and H2O's), `keynorm` with AdaKV (a pooled cache), and `quest` (keeps every token; a
decode step gathers the pages it selects and attends over those only). Quantized
caches (`int:8`, `kivi:2`, `kvquant:3`) keep every token; attention reads a dequantized fp32 copy
built each step (no fused dequantizing kernel yet), so they are expected to be slower than the full
cache here even though they store 4-10x fewer bytes. `palu:0.5` rebuilds K/V from rank-r latents
each step (its bases, which do not change the time, are calibrated on random tokens here).

    python scripts/bench_compression.py [--model smollm2] [--context 8192] [--ratios 0.75 0.5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import decode_step_time  # noqa: E402
from bench_mla import filled_cache  # noqa: E402

from kvjax import Generator  # noqa: E402
from kvjax.cache import caches_nbytes  # noqa: E402
from kvjax.compress import compress_caches, compressible, parse_policy, plan_stages, prepare_policy  # noqa: E402
from kvjax.config import ConfigError  # noqa: E402
from kvjax.plan import init_caches  # noqa: E402
from kvjax.report import format_bytes, format_table  # noqa: E402

LAYOUTS = ("streaming", "keynorm", "keynorm:allocator=adakv", "quest")
QUANTIZED = ("int:8", "kivi:2", "kvquant:3", "gear:2", "palu:0.5")  # keep every token; attention rebuilds K/V


def compressed(model, full, lengths, room: int, policy, calibration):
    """`full` caches (prompts of `lengths` tokens) compressed by `policy` with `room` free slots after,
    without an attention observation (its stages need none); Palu calibrates on `calibration` tokens."""
    prepared = prepare_policy(policy, model, calibration=calibration)
    plans = plan_stages(model.config, policy.stages, lengths, headroom=room, **prepared)
    statics, arrays = tuple(p.static for p in plans), tuple(p.arrays for p in plans)
    last = jnp.asarray(lengths - 1)
    return compress_caches(full, (None,) * len(full), statics, arrays, last, compressible(model.config))[0]


def load(model_ref: str):
    from kvjax.training.loading import load_model

    return load_model(model_ref).model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a run directory, a .gguf file or smollm2")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--ratios", type=float, nargs="+", default=[0.75, 0.5], help="compression ratios, the fractions removed"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--policy", action="append", help="measure this policy (ratio -) instead of the default set; repeatable"
    )
    args = parser.parse_args()
    for text in args.policy or ():
        parse_policy(text)  # a bad policy fails here, before the model loads

    model = load(args.model)
    cfg = model.config
    # Free slots after the context (and after each compressed budget): a multiple of 64, like
    # kvjax.generate's default capacity, so that caches take the blocked decode path (kvjax.ops).
    B, n, room = args.batch, args.context, -(-(args.steps + 2) // 64) * 64
    lengths = np.full((B,), n, np.int32)
    logits = jnp.zeros((B, cfg.vocab_size), jnp.float32)
    gen = Generator(model, capacity=n + room)
    full = tuple(filled_cache(c, n) for c in init_caches(cfg, B, n + room))
    base, _ = decode_step_time(gen, full, logits, lengths, args.steps, args.repeats)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    full_bytes = caches_nbytes(full)
    rows = [["full", "0", format_bytes(full_bytes), f"{base * 1e3:.1f}", "1.00x", "1.00x", "1.00"]]
    rng_tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64))
    runs = [
        (f"{name}:{ratio:g}" + (f":{options}" if options else ""), f"{ratio:g}")
        for ratio in args.ratios
        for name, _, options in (layout.partition(":") for layout in LAYOUTS)
    ]
    if args.policy:
        runs = [(text, "-") for text in args.policy]
    else:
        runs += [(text, "-") for text in QUANTIZED]
    for text, ratio in runs:
        policy = parse_policy(text)
        caches = compressed(model, full, lengths, room, policy, rng_tokens)  # Palu: random tokens calibrate
        step, _ = decode_step_time(gen, caches, logits, lengths, args.steps, args.repeats)
        # What the bytes predict: the step reads the weights and the cache (issue 23's yardstick).
        predicted = (weights + caches_nbytes(caches)) / (weights + full_bytes)
        rows.append(
            [
                str(policy),
                ratio,
                format_bytes(caches_nbytes(caches)),
                f"{step * 1e3:.1f}",
                f"{step / base:.2f}x",
                f"{predicted:.2f}x",
                f"{step / base / predicted:.2f}",
            ]
        )
    print(
        f"{cfg.name}, batch {B}, context {n}, fp32, weights {format_bytes(weights)}: decode step time (ms) per "
        "cache layout; 'bytes predict' = (weights + cache bytes) / (weights + full cache bytes), 'ratio' = "
        "vs full / bytes predict"
    )
    print(format_table(["policy", "ratio", "cache bytes", "step ms", "vs full", "bytes predict", "ratio"], rows))


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a bad model reference or policy: one line, before any timing
        sys.exit(f"bench_compression: {error}")

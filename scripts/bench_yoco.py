"""Prefill time and cache bytes of YOCO (early exit) against a GQA transformer of equal depth and width.

Both are the compare shape (`configs/models/gqa.yaml`, `yoco-swa.yaml`, `yoco-gret.yaml`: d_model 128,
4 layers, 8 query heads, 2 K/V heads), batch 1, fp32. Prompts are prefilled in chunks of `--chunk`
tokens (as a serving system would, so that a 16k-token prompt fits in memory) through
`Generator.prefill(..., chunk=)` (`Decoder.prefill_last` per chunk): YOCO runs its self-decoder and the
global K/V projection over every token, and its cross-decoder only for the last token; GQA runs every
layer over every token (its last layer's queries only for the last token). Ratios are against GQA at the same
length, in the same process.

    python scripts/bench_yoco.py [--lengths 1024 4096 16384] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from flax import nnx

from kvjax.architectures import Decoder
from kvjax.cache import caches_nbytes
from kvjax.config import load_config
from kvjax.generate import Generator
from kvjax.report import format_bytes, format_table

VARIANTS = ("gqa", "yoco-swa", "yoco-gret")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    rows = []
    for length in args.lengths:
        prompt = np.random.default_rng(0).integers(0, 256, (1, length))
        seconds, nbytes = {}, {}
        for name in VARIANTS:
            gen = Generator(Decoder(load_config(name).model, rngs=nnx.Rngs(0)), capacity=length)
            lengths = np.array([length], np.int32)
            _, caches = jax.block_until_ready(gen.prefill(prompt, lengths, chunk=args.chunk))  # compiles
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(gen.prefill(prompt, lengths, chunk=args.chunk))
                times.append(time.perf_counter() - start)
            seconds[name], nbytes[name] = min(times), caches_nbytes(caches)
        for name in VARIANTS:
            rows.append(
                [
                    length,
                    name,
                    f"{seconds[name] * 1e3:,.0f}",
                    f"{seconds[name] / seconds['gqa']:.2f}x",
                    format_bytes(nbytes[name]),
                    f"{nbytes[name] / nbytes['gqa']:.3f}",
                ]
            )
        print(f"... {length} tokens done", file=sys.stderr)
    print(f"prefill of one prompt in chunks of {args.chunk}, fp32, compare shape (d_model 128, 4 layers)")
    print(format_table(["prompt tokens", "variant", "prefill ms", "vs GQA", "cache bytes", "vs GQA"], rows))


if __name__ == "__main__":
    main()

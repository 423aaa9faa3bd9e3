"""Decode step time of MLA (naive and absorbed) against GQA at growing cache lengths, in one run.

All three are the compare shape (`configs/models/mla.yaml`, `gqa.yaml`: d_model 128, 4 layers, 8 query
heads). The absorbed path reads only the latent cache (a quarter of GQA's bytes here); the naive one
reads the same latents but rebuilds per-head K/V for every cached token at every step, so the absorbed
path should gain on it as the cache grows. The caches are filled with random entries at positions
0..length-1 (a 16k-token prefill of 8 rows would not fit in memory in one call, and decode time does not
depend on the values); times are per decode step, ratios against GQA at the same length, in one process.

    python scripts/bench_mla.py [--batch 8] [--lengths 1024 4096 16384] [--steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import decode_step_time  # noqa: E402

from kvjax import Generator  # noqa: E402
from kvjax.architectures import Decoder  # noqa: E402
from kvjax.cache import caches_nbytes  # noqa: E402
from kvjax.config import load_config  # noqa: E402
from kvjax.plan import init_caches  # noqa: E402
from kvjax.report import format_bytes, format_table  # noqa: E402

VARIANTS = {"gqa": ("gqa", []), "mla naive": ("mla", ["model.mla.absorb=false"]), "mla absorbed": ("mla", [])}


def filled_cache(cache, length: int):
    """`cache` holding random entries at positions 0..length-1 in its first `length` slots."""
    payload = [
        f.name
        for f in dataclasses.fields(cache)
        if f.name not in ("pos", "length") and f.metadata.get("pytree_node", True)
    ]  # arrays, not flags
    keys = jax.random.split(jax.random.key(0), len(payload))
    B, S = cache.pos.shape
    slots = jnp.arange(S, dtype=jnp.int32)
    return cache.replace(
        **{name: jax.random.normal(key, getattr(cache, name).shape) for name, key in zip(payload, keys)},
        pos=jnp.broadcast_to(jnp.where(slots < length, slots, -1), (B, S)),
        length=jnp.full((B,), length, jnp.int32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for length in args.lengths:
        times = {}
        for label, (name, overrides) in VARIANTS.items():
            cfg = load_config(name, overrides).model
            gen = Generator(Decoder(cfg, rngs=nnx.Rngs(0)), capacity=length)
            filled = length - args.steps - 1
            caches = tuple(filled_cache(c, filled) for c in init_caches(cfg, args.batch, length))
            logits = jnp.zeros((args.batch, cfg.vocab_size))
            lengths = np.full((args.batch,), filled)
            times[label], caches = decode_step_time(gen, caches, logits, lengths, args.steps, args.repeats)
            rows.append([length, label, format_bytes(caches_nbytes(caches)), f"{times[label] * 1e3:.2f}"])
        for row in rows[-len(VARIANTS) :]:
            row.append(f"{times[row[1]] / times['gqa']:.2f}x")
        print(f"... {length} tokens done", file=sys.stderr)
    print(f"decode step time, batch {args.batch}, fp32, compare shape (d_model 128, 4 layers, 8 heads)")
    print(format_table(["cache length", "variant", "cache bytes", "step ms", "vs GQA"], rows))


if __name__ == "__main__":
    main()

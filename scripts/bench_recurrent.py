"""Training and decoding speed of the cache-free mixers (Mamba, RWKV-7, the Mamba/attention hybrid)
against GQA of equal width and depth, and decode step time at two context lengths, in one run.

All models are the compare shape (d_model 128, 4 layers), fp32. Training: tokens/s of a jitted
AdamW step on random tokens (`--batch` x `--seq-len`). Decoding: the step time of the jitted decode
loop at batch `--decode-batch`, after caches are filled to each context length with random entries
(recurrent states need no filling: their size and cost do not depend on the context). A recurrent
model's decode step should stay flat from 1k to 8k tokens; GQA's grows with its cache.

    python scripts/bench_recurrent.py [--contexts 1024 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import best_of, decode_step_time  # noqa: E402
from bench_mla import filled_cache  # noqa: E402

from kvjax import Generator  # noqa: E402
from kvjax.architectures import Decoder  # noqa: E402
from kvjax.config import load_config  # noqa: E402
from kvjax.plan import init_caches  # noqa: E402
from kvjax.report import format_table  # noqa: E402
from kvjax.training.trainer import token_losses  # noqa: E402

VARIANTS = ("gqa", "mamba", "rwkv7", "hybrid-mamba-attn")


def train_tokens_per_s(model: Decoder, batch: int, seq_len: int, repeats: int) -> float:
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-3)

    @jax.jit
    def step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(lambda p: token_losses(graphdef, p, windows).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    windows = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)), jnp.int32)
    state = [params, tx.init(params)]

    def run():
        state[0], state[1], loss = step(state[0], state[1], windows)
        loss.block_until_ready()

    run()
    return batch * seq_len / best_of(run, repeats)


def decode_time(model: Decoder, batch: int, context: int, steps: int, repeats: int) -> float:
    cfg = model.config
    filled = context - steps - 1
    caches = tuple(filled_cache(c, filled) if hasattr(c, "pos") else c for c in init_caches(cfg, batch, context))
    logits = jnp.zeros((batch, cfg.vocab_size))
    step, _ = decode_step_time(
        Generator(model, capacity=context), caches, logits, np.full((batch,), filled), steps, repeats
    )
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs=2, default=[1024, 8192])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS[1:], default=VARIANTS[1:], help="measured against gqa (always run)"
    )
    args = parser.parse_args()

    rows, base = [], {}
    for name in ("gqa", *args.variants):
        model = Decoder(load_config(name).model, rngs=nnx.Rngs(0))
        train = train_tokens_per_s(model, args.batch, args.seq_len, args.repeats)
        short, long = (decode_time(model, args.decode_batch, c, args.steps, args.repeats) for c in args.contexts)
        base = base or {"train": train, "decode": args.decode_batch / long}
        rows.append(
            [
                name,
                f"{train:,.0f}",
                f"{train / base['train']:.2f}x",
                f"{args.decode_batch / long:,.0f}",
                f"{args.decode_batch / long / base['decode']:.2f}x",
                f"{short * 1e3:.2f}",
                f"{long * 1e3:.2f}",
                f"{long / short:.2f}x",
            ]
        )
        print(f"... {name} done", file=sys.stderr)
    lo, hi = args.contexts
    print(
        f"compare shape (d_model 128, 4 layers), fp32; training batch {args.batch} x {args.seq_len}, "
        f"decode batch {args.decode_batch}; ratios against GQA in this run"
    )
    print(
        format_table(
            [
                "variant",
                "train tok/s",
                "vs GQA",
                f"decode tok/s @{hi}",
                "vs GQA",
                f"step ms @{lo}",
                f"step ms @{hi}",
                f"@{hi} / @{lo}",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()

"""Training throughput of a ~10M-parameter GQA model and its CPU MFU, against a matmul peak measured in
the same run.

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): 6 * params + 12 * layers * seq_len *
(n_heads * head_dim), i.e. forward + backward of every weight matmul plus the attention scores and
values (counted as full, not causal, attention).

    python scripts/bench_train.py [--batch 16] [--seq-len 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BENCH_MODEL, best_of  # noqa: E402

from kvjax.config import Config, DataConfig, TrainConfig  # noqa: E402
from kvjax.report import format_table  # noqa: E402
from kvjax.training.trainer import Trainer  # noqa: E402


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of a jitted n x n x n matmul."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    return 2 * n**3 / best_of(lambda: mm(a, a).block_until_ready(), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--corpus", default="python-stdlib")
    args = parser.parse_args()

    model_cfg = dataclasses.replace(BENCH_MODEL, vocab_size=264)
    config = Config(
        model=model_cfg,
        data=DataConfig(corpus=args.corpus, seq_len=args.seq_len, eval_windows=1),
        train=TrainConfig(
            steps=args.steps + 2,
            batch_size=args.batch,
            warmup_steps=1,
            eval_every=10**9,
            checkpoint_every=10**9,
            log_every=1,
        ),
    )
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, progress=False)
        history = trainer.run()
    # Each row's tokens/s covers the time since the previous row; the first two include compilation.
    rates = sorted(row["tokens_per_s"] for row in history[2:])
    tokens_per_s = rates[len(rates) // 2]
    params = sum(p.size for p in jax.tree.leaves(nnx.state(trainer.model(), nnx.Param)))
    att = model_cfg.attention
    flops_per_token = 6 * params + 12 * model_cfg.n_layers * args.seq_len * att.n_heads * att.head_dim
    achieved = flops_per_token * tokens_per_s
    peak = matmul_peak()
    print(f"model {model_cfg.name}: {params / 1e6:.2f}M params, batch {args.batch} x {args.seq_len} tokens, fp32")
    print(
        format_table(
            ["quantity", "value"],
            [
                ["training tokens/s", f"{tokens_per_s:,.0f}"],
                ["FLOPs per token", f"{flops_per_token / 1e6:.1f} M"],
                ["achieved", f"{achieved / 1e9:.1f} GFLOP/s"],
                ["matmul peak (measured)", f"{peak / 1e9:.1f} GFLOP/s"],
                ["MFU", f"{achieved / peak:.1%}"],
            ],
        )
    )


if __name__ == "__main__":
    main()

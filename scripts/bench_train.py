"""Training throughput of a ~10M-parameter GQA model and its CPU MFU, against a matmul peak measured in
the same run.

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): 6 * params + 12 * layers * seq_len *
(n_heads * head_dim), i.e. forward + backward of every weight matmul plus the attention scores and
values (counted as full, not causal, attention).

With `--processes N` it measures instead what spreading training over processes costs: the same run as
1 process of `--devices` CPU devices and as N processes of devices/N each (JAX's multi-controller runtime
on the loopback, gloo collectives; `kvjax launch`), tokens/s of each and their ratio.

    python scripts/bench_train.py [--batch 16] [--seq-len 256] [--steps 10] [--model gqa]
                                  [--processes 2 --devices 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BENCH_MODEL, best_of  # noqa: E402

from kvjax.commands.launch import environments, free_port  # noqa: E402
from kvjax.config import Config, DataConfig, TrainConfig, load_config  # noqa: E402
from kvjax.report import format_table  # noqa: E402
from kvjax.training.distributed import initialize, is_primary  # noqa: E402
from kvjax.training.trainer import Trainer  # noqa: E402


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of a jitted n x n x n matmul."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    return 2 * n**3 / best_of(lambda: mm(a, a).block_until_ready(), repeats)


def measure(args) -> tuple[float, Trainer, object]:
    """Median training tokens/s of `args.steps` steps (after two that compile), the trainer and model config."""
    model_cfg = load_config(args.model).model if args.model else dataclasses.replace(BENCH_MODEL, vocab_size=264)
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
    with tempfile.TemporaryDirectory() as scratch:  # the processes of one run share its directory
        trainer = Trainer(config, args.run_dir or scratch, progress=False)
        history = trainer.run()
    # Each row's tokens/s covers the time since the previous row; the first two include compilation.
    rates = sorted(row["tokens_per_s"] for row in history[2:])
    return rates[len(rates) // 2], trainer, model_cfg


def processes_table(args) -> None:
    """The run as 1 process of all devices and as N processes (this script again, once per process)."""
    rows, scratch = [], tempfile.mkdtemp()
    for n in (1, args.processes):
        envs = environments(n, free_port(), args.devices // n)
        argv = [sys.executable, __file__, *sys.argv[1:], "--child", f"--run-dir={scratch}/{n}"]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for env in envs]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"{n} process(es): exit status {[p.returncode for p in procs]}")
        rows.append([f"{n} x {args.devices // n}", json.loads(outs[0].strip().splitlines()[-1])["tokens_per_s"]])
    base = rows[0][1]
    print(f"model {args.model or BENCH_MODEL.name}, batch {args.batch} x {args.seq_len} tokens, fp32, CPU devices")
    print(
        format_table(
            ["processes x devices", "training tokens/s", "vs 1 process"],
            [[name, f"{rate:,.0f}", f"{rate / base:.2f}x"] for name, rate in rows],
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--corpus", default="python-stdlib")
    parser.add_argument("--model", help="a shipped model config (default: a ~10M-parameter GQA model)")
    parser.add_argument("--processes", type=int, default=1, help="compare 1 process with this many")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices in all, with --processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one process of --processes
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)  # the run directory its processes share
    args = parser.parse_args()
    if args.child:
        initialize()
        tokens_per_s, _, _ = measure(args)
        if is_primary():
            print(json.dumps({"tokens_per_s": tokens_per_s}))
        return
    if args.processes > 1:
        processes_table(args)
        return
    tokens_per_s, trainer, model_cfg = measure(args)
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

"""The `kvjax` command: the composition root that wires configs, models and reports together."""

from __future__ import annotations

import argparse
import sys

from kvjax import memory
from kvjax.config import ConfigError, load_config
from kvjax.report import format_bytes, format_table


def _split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments containing '=' are overrides; the rest name configs."""
    return [a for a in items if "=" not in a], [a for a in items if "=" in a]


def memory_table(names: list[str], overrides: list[str], tokens: list[int], batch: int) -> str:
    """One row per config: shape, K/V bytes per token, whole-cache bytes, and the ratio to MHA."""
    headers = ["variant", "layers", "KV heads", "head dim", "dtype", "KV B/token", "cache B/token"]
    headers += [f"cache @{t // 1024}k" if t % 1024 == 0 else f"cache @{t}" for t in tokens]
    headers += [f"vs MHA @{tokens[-1] // 1024}k" if tokens[-1] % 1024 == 0 else "vs MHA"]
    rows = []
    for name in names:
        cfg = load_config(name, overrides).model
        att = cfg.attention
        total = [memory.cache_bytes(cfg, t, batch) for t in tokens]
        mha = memory.cache_bytes(memory.mha_reference(cfg), tokens[-1], batch)
        rows.append(
            [
                cfg.name,
                cfg.n_layers,
                att.n_kv_heads,
                att.head_dim,
                cfg.dtype,
                memory.kv_bytes_per_token(cfg),
                memory.cache_bytes_per_token(cfg),
                *(format_bytes(b) for b in total),
                f"{total[-1] / mha:.4f}",
            ]
        )
    return format_table(headers, rows)


def _cmd_memory(args) -> None:
    names, overrides = _split_overrides(args.configs)
    if not names:
        raise ConfigError("kvjax memory needs at least one config (a YAML path or a shipped name)")
    if args.batch <= 0 or any(t <= 0 for t in args.tokens):
        raise ConfigError(f"--batch={args.batch} and --tokens={args.tokens} must be > 0")
    print(memory_table(names, overrides, sorted(args.tokens), args.batch))
    print(
        f"\nKV B/token: K and V of every caching layer (the papers' figure). cache B/token adds each slot's"
        f" int32 position. Cache columns: all arrays of all layers for batch {args.batch}, sliding windows"
        f" capped; the ratio compares with MHA of the same shape."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="analytic KV-cache memory of model configs")
    mem.add_argument("configs", nargs="+", help="YAML paths or shipped names, then key.sub=value overrides")
    mem.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], help="sequence lengths")
    mem.add_argument("--batch", type=int, default=1)
    mem.set_defaults(run=_cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except ConfigError as e:
        print(f"kvjax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

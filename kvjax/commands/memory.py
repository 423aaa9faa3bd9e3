"""`kvjax memory`: analytic KV-cache bytes of model configs or models (shipped, GGUF, Hugging Face, run
directories: their config only, no weights are read), side by side."""

from __future__ import annotations

from kvjax.commands.args import POSITIVE, split_overrides
from kvjax.errors import ConfigError


def _kv_shape(cfg) -> tuple[str, str]:
    """(KV heads, head dim) columns: an MLA layer caches one latent plus one shared RoPE key."""
    from kvjax.plan import sharable_kinds

    if "mla" in cfg.mixers:
        rope = (
            cfg.mla.qk_rope_head_dim if cfg.mla.rope_heads == 1 else f"{cfg.mla.rope_heads}x{cfg.mla.qk_rope_head_dim}"
        )
        return "latent", f"{cfg.mla.kv_lora_rank}+{rope}"
    if not set(sharable_kinds()) & set(cfg.mixers):
        return "-", "-"
    return str(cfg.attention.n_kv_heads), str(cfg.attention.head_dim)


def _config(name: str, overrides: list[str]):
    """A config by name or path, or the config of a model reference, with the overrides applied. A model's
    own section for a kind that an overridden `model.layer_pattern` drops goes with it (Gemma 3 with
    `model.layer_pattern=[attention]` has no `local` layers left to configure); a section the overrides
    set themselves is checked as given."""
    from kvjax.config import Config, apply_overrides, from_dict, load_config
    from kvjax.kinds import KINDS
    from kvjax.training.loading import is_model_ref, model_config

    if not is_model_ref(name):
        return load_config(name, overrides)
    tree = apply_overrides(model_config(name).to_dict(), overrides)
    model, named = tree["model"], [item.partition("=")[0] for item in overrides]
    used = {KINDS[k].section for k in model["layer_pattern"] if k in KINDS}
    for section in {kind.section for kind in KINDS.values()} - used - {None}:
        if not any(key == f"model.{section}" or key.startswith(f"model.{section}.") for key in named):
            model[section] = None
    return from_dict(Config, tree)


def memory_table(names: list[str], overrides: list[str], tokens: list[int], batch: int) -> str:
    """One row per config: shape, K/V bytes per token, whole-cache bytes, and the ratio to MHA."""
    from kvjax import memory
    from kvjax.kinds import KINDS
    from kvjax.report import format_bytes, format_table

    headers = ["variant", "layers", "KV layers", "KV heads", "head dim", "dtype", "KV B/token", "cache B/token"]
    headers += ["state B/seq"]
    headers += [f"cache @{t // 1024}k" if t % 1024 == 0 else f"cache @{t}" for t in tokens]
    headers += [f"vs MHA @{tokens[-1] // 1024}k" if tokens[-1] % 1024 == 0 else "vs MHA"]
    rows = []
    for name in names:
        cfg = _config(name, overrides).model
        total = [memory.cache_bytes(cfg, t, batch) for t in tokens]
        mha = memory.cache_bytes(memory.mha_reference(cfg), tokens[-1], batch)
        rows.append(
            [
                cfg.name,
                cfg.n_layers,
                sum(KINDS[cfg.mixers[i]].caches_tokens for i in set(cfg.kv_source)),
                *_kv_shape(cfg),
                cfg.dtype,
                memory.kv_bytes_per_token(cfg),
                memory.cache_bytes_per_token(cfg),
                memory.state_bytes_per_sequence(cfg),
                *(format_bytes(b) for b in total),
                f"{total[-1] / mha:.4f}",
            ]
        )
    return format_table(headers, rows)


def device_table(name: str, overrides: list[str], tokens: list[int], batch: int, chunk: int, compile: bool) -> str:
    """One model's generation memory at each context: the analytic budget of a prefill chunk and of a
    decode step (weights, caches, activations) and, with `compile`, XLA's analysis of the programs."""
    import jax
    from flax import nnx

    from kvjax import footprint
    from kvjax.architectures import Decoder
    from kvjax.report import format_table

    cfg = _config(name, overrides).model
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only: nothing is allocated
    headers = ["context", "program", "weights", "caches", "activations", "budget"]
    headers += ["compiled temps", "compiled peak", "peak / budget"] if compile else []
    rows = []
    for t in tokens:
        budgets = footprint.budgets(model, batch, t, min(chunk, t))
        analysed = footprint.compiled(model, batch, t, min(chunk, t)) if compile else (None, None)
        for plan, got in zip(budgets, analysed):
            row = [t, plan.program, *map(footprint.gib, (plan.weights, plan.caches, plan.activations, plan.total))]
            if got is not None:
                row += [footprint.gib(got.temporaries), footprint.gib(got.peak), f"{got.peak / plan.total:.2f}"]
            rows.append(row)
    where = f"compiled for this host's {jax.default_backend()} backend" if compile else "analytic only (--compiled)"
    return f"{cfg.name}, batch {batch}, {cfg.dtype}: {where}\n" + format_table(headers, rows)


def run(args) -> None:
    names, overrides = split_overrides(args.configs)
    if not names:
        raise ConfigError("kvjax memory needs at least one config (a YAML path or a shipped name)")
    print(memory_table(names, overrides, sorted(args.tokens), args.batch))
    if args.budget or args.compiled:
        for name in names:
            print()
            print(device_table(name, overrides, sorted(args.tokens), args.batch, args.chunk, args.compiled))
        print(
            "\nBudget: what generation holds on the device: the weights, the caches at the context, and the"
            " largest live activations (one layer's, scores a key block at a time, fp32 logits). Compiled:"
            " XLA's memory_analysis() of the Generator's programs compiled from abstract inputs (nothing is"
            " allocated); peak = arguments + outputs not written in place + temporaries. On a CPU, XLA computes"
            " bf16 dots in fp32 and holds fp32 copies of their operands, and at batch 1 a decode step copies"
            " the caches (docs/accelerators.md): compile on the device for its own figure."
        )
    print(
        f"\nKV layers: layers that store K/V (or an MLA latent). KV B/token: what each token adds to the caches"
        f" that grow without bound (the papers' figure); cache B/token adds each slot's int32 position."
        f" state B/seq: what does not grow: full sliding-window rings, recurrent states, length counters."
        f" Cache columns: all arrays of all layers for batch {args.batch}; the ratio compares with MHA of the"
        f" same shape."
    )


def register(sub) -> None:
    mem = sub.add_parser("memory", help="analytic KV-cache memory of model configs and models")
    mem.add_argument(
        "configs",
        nargs="+",
        help="YAML paths or shipped config names, or models (smollm2, gemma3, a .gguf file, a Hugging Face or "
        "run directory), then key.sub=value overrides",
    )
    mem.add_argument(
        "--tokens",
        type=POSITIVE,
        nargs="+",
        default=[4096, 32768],
        help="sequence lengths of the cache columns (default: 4096 32768)",
    )
    mem.add_argument("--batch", type=POSITIVE, default=1, help="sequences per cache (default: 1)")
    mem.add_argument(
        "--budget",
        action="store_true",
        help="also each model's device budget for generation at each --tokens: weights, caches, activations",
    )
    mem.add_argument(
        "--compiled",
        action="store_true",
        help="the budget beside XLA's memory analysis of the compiled prefill chunk and decode (abstract "
        "inputs: nothing is allocated; an 8B model at 128k compiles in about 20 s)",
    )
    mem.add_argument("--chunk", type=POSITIVE, default=2048, help="prefill chunk of the budget (default: 2048)")
    mem.set_defaults(run=run)

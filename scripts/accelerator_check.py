"""One prepared accelerator run: kvjax end to end on the device at hand against its roofline and against
transformers on the same device, written as JSON and a markdown table. Models of real shapes (Llama-3.2-1B,
Llama-3.1-8B) get random weights made on the device (nothing is downloaded; a step's time does not depend
on the values); the 1B shape is written by transformers (`from_config`, `save_pretrained`) and read back
by kvjax, so both sides also score the same weights. `--tiny` runs every section at toy shapes (the test
suite does, on a CPU, so the script cannot rot while no accelerator is at hand).

Sections (each timed as the median of rounds after one that compiles; a section that fails is recorded
with its error and the others go on):
  device     the chip, jax and torch versions; HBM bandwidth of a device copy; bf16 matmul FLOP/s
  parity     the 1B shape's logits in kvjax and transformers on the same weights (bf16)
  memory     XLA's memory analysis of the prefill chunk and decode of each shape at 32k and 128k,
             compiled for the device from abstract inputs, against `kvjax memory --budget`
  prefill    tokens/s at each context, batch 1: kvjax (model.attention.impl=auto) and transformers (SDPA),
             and MFU against the measured matmul rate
  decode     tokens/s at each batch and context from a cache filled to the context: kvjax, transformers
             (SDPA, a DynamicCache holding the same number of tokens) and the roofline (weights + K/V
             bytes over the measured bandwidth)
  compressed decode step time at the longest context and largest batch under each cache layout the
             token-level policies make (keynorm:0.75 keeps 25% per head, as SnapKV and H2O do; streaming
             25% shared by the heads, as TOVA; Quest reads 12.5% of the pages; int:8 and KIVI-2 codes),
             against the full cache and against their bytes (policies that need no attention
             observation, since random caches have none)
  engine     kvjax.Engine serving random requests at the largest batch (tokens/s, peak pages)
  train      a training step of the smallest shape, fp32 master weights under bf16 compute: tokens/s and
             MFU (6 N FLOPs per token plus attention)

    python scripts/accelerator_check.py [--tiny] [--out runs/accelerator] [--only decode prefill]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import compressed  # noqa: E402
from bench_mla import filled_cache  # noqa: E402

from kvjax import DecodingConfig, Engine, Generator, Request  # noqa: E402
from kvjax.architectures import Decoder  # noqa: E402
from kvjax.cache import caches_nbytes  # noqa: E402
from kvjax.compress import parse_policy  # noqa: E402
from kvjax.config import Config, DataConfig, TrainConfig  # noqa: E402
from kvjax.plan import init_caches  # noqa: E402
from kvjax.report import format_table  # noqa: E402
from kvjax.timing import rounds  # noqa: E402
from kvjax.training.families.llama import from_hf  # noqa: E402

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5)
SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {  # the config.json fields that decide a model's shape (Meta's published configs)
    "llama-3.2-1b": dict(
        LLAMA,
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(SCALING, factor=32.0),
        max_position_embeddings=131072,
    ),
    "llama-3.1-8b": dict(
        LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(SCALING, factor=8.0),
        max_position_embeddings=131072,
    ),
    "tiny": dict(
        LLAMA,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=512,
    ),
}
PLANS = {  # what each section runs: full on an accelerator, tiny in the test suite
    "full": dict(
        shapes=("llama-3.2-1b", "llama-3.1-8b"),
        parity="llama-3.2-1b",
        prefill=(8192, 32768),
        batches=(1, 8, 64),
        contexts=(4096, 32768),
        memory=(32768, 131072),
        policies=("keynorm:0.75", "streaming:0.75", "quest:0.875", "int:8", "kivi:2"),
        requests=256,
        train=("llama-3.2-1b", 8, 2048),
        copy_bytes=1 << 32,
        matmul=8192,
        repeats=3,
        steps=16,
    ),
    "tiny": dict(
        shapes=("tiny",),
        parity="tiny",
        prefill=(128,),
        batches=(2,),
        contexts=(64, 128),
        memory=(128,),
        policies=("keynorm:0.75", "int:8"),
        requests=4,
        train=("tiny", 2, 64),
        copy_bytes=1 << 22,
        matmul=128,
        repeats=1,
        steps=4,
    ),
}
SECTIONS = ("device", "parity", "memory", "prefill", "decode", "compressed", "engine", "train")
DTYPE = "bfloat16"


def kvjax_config(shape: str):
    """The kvjax ModelConfig of a shape, in bf16, attention by the platform's best implementation."""
    cfg = from_hf(SHAPES[shape], shape)
    return dataclasses.replace(cfg, dtype=DTYPE, attention=dataclasses.replace(cfg.attention, impl="auto"))


def torch_model(shape: str, device: str):
    """transformers' Llama of a shape with random weights, bf16, SDPA attention, on `device`."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    return model


def median(seconds: list[float]) -> float:
    return float(np.median(seconds))


def device_section(plan) -> list[dict]:
    """The chip, versions, the HBM rate of a device copy (bytes read + written) and bf16 matmul FLOP/s."""
    import torch

    x = jnp.ones((plan["copy_bytes"] // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)  # one read and one write of every byte
    copy_s = median(rounds(lambda: copy(x), plan["repeats"] + 2)[0])
    n = plan["matmul"]
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    mm_s = median(rounds(lambda: mm(a), plan["repeats"] + 2)[0])
    device = jax.devices()[0]
    return [
        dict(
            device=device.device_kind,
            platform=device.platform,
            jax=jax.__version__,
            torch=torch.__version__,
            python=platform.python_version(),
            hbm_gb_s=2 * x.nbytes / copy_s / 1e9,
            matmul_tflops=2 * n**3 / mm_s / 1e12,
        )
    ]


def parity_section(plan, torch_device: str) -> list[dict]:
    """One shape written by transformers and read by kvjax: the largest logit difference over 64 tokens."""
    import torch

    from kvjax.training.hf_import import load_hf_model

    shape = plan["parity"]
    reference = torch_model(shape, torch_device)
    ids = np.random.default_rng(0).integers(0, SHAPES[shape]["vocab_size"], (1, 64))
    with torch.no_grad():
        want = reference(torch.tensor(ids, device=torch_device)).logits.float().cpu().numpy()
    with tempfile.TemporaryDirectory() as where:
        reference.save_pretrained(where)
        _, model = load_hf_model(where, dtype=DTYPE)
    got = np.asarray(model(jnp.asarray(ids), jnp.arange(64)[None])[0], np.float32)
    return [
        dict(shape=shape, max_abs_logit_diff=float(np.abs(got - want).max()), logit_scale=float(np.abs(want).max()))
    ]


def _params(model) -> tuple[int, int]:
    """(parameters, their bytes) of a model, or of its abstract shapes (`nnx.eval_shape`)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(x.size for x in leaves), sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)


def _torch_call(model, ids, cache):
    """One forward with transformers' cache, under its current keyword (`cache=`) or the older one."""
    try:
        return model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    except TypeError:
        return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def prefill_section(plan, models, peak: float, torch_device: str) -> list[dict]:
    """Batch-1 prefill tokens/s at each context: kvjax and transformers, and kvjax's MFU."""
    import torch

    rows = []
    for shape, (model, reference) in models.items():
        cfg = model.config
        n_params, _ = _params(model)
        for T in plan["prefill"]:
            tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T))
            gen = Generator(model, capacity=T + 1)
            padded, lengths = gen.pad(tokens.tolist(), 1)
            ours = median(rounds(lambda: gen.prefill(padded, lengths), plan["repeats"])[0])

            def theirs():
                with torch.no_grad():
                    _torch_call(reference, torch.tensor(tokens, device=torch_device), None)
                _sync(torch_device)

            ref = median(rounds(theirs, plan["repeats"])[0])
            att = cfg.attention
            flops = 2 * n_params * T + 2 * cfg.n_layers * att.n_heads * att.head_dim * T * T  # causal: half of 4
            rows.append(
                dict(
                    shape=shape,
                    tokens=T,
                    kvjax_tok_s=T / ours,
                    transformers_tok_s=T / ref,
                    vs_transformers=ref / ours,
                    mfu=flops / ours / peak,
                )
            )
    return rows


def _filled(cfg, batch: int, context: int, room: int):
    """Caches of `batch` rows holding `context` random tokens, with `room` free slots after them."""
    return tuple(filled_cache(c, context) for c in init_caches(cfg, batch, context + room))


def _step_time(gen, caches, logits, lengths, steps: int, repeats: int) -> float:
    """Seconds per decode step: the loop generating 1 + steps tokens minus the one generating 1."""

    def run(n):
        return rounds(
            lambda fresh: gen.decode(fresh, logits, lengths, DecodingConfig(max_new_tokens=n), jax.random.key(0)),
            repeats,
            setup=lambda: jax.tree.map(jnp.copy, caches),
        )[0]

    return max(1e-9, (median(run(1 + steps)) - median(run(1))) / steps)


def decode_section(plan, models, bandwidth: float, torch_device: str) -> list[dict]:
    """Decode tokens/s from a filled cache at each batch and context: kvjax against its roofline and
    against transformers holding a cache of the same length."""
    rows = []
    for shape, (model, reference) in models.items():
        cfg = model.config
        _, weight_bytes = _params(model)
        for context in plan["contexts"]:
            for batch in plan["batches"]:
                room = plan["steps"] + 2
                caches = _filled(cfg, batch, context, room)
                gen = Generator(model, capacity=context + room)
                lengths = np.full((batch,), context, np.int32)
                logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
                step = _step_time(gen, caches, logits, lengths, plan["steps"], plan["repeats"])
                floor = (weight_bytes + caches_nbytes(caches)) / bandwidth
                theirs = _torch_step(reference, cfg, batch, context, plan, torch_device)
                rows.append(
                    dict(
                        shape=shape,
                        context=context,
                        batch=batch,
                        kvjax_tok_s=batch / step,
                        transformers_tok_s=batch / theirs,
                        vs_transformers=theirs / step,
                        roofline_fraction=floor / step,
                    )
                )
                del caches
    return rows


def _torch_step(reference, cfg, batch: int, context: int, plan, device: str) -> float:
    """transformers' decode step time (median) with a DynamicCache of `context` random tokens a row."""
    import torch
    from transformers import DynamicCache

    att = cfg.attention
    shape = (batch, att.n_kv_heads, context, att.head_dim)
    layers = [
        (
            torch.randn(shape, dtype=torch.bfloat16, device=device),
            torch.randn(shape, dtype=torch.bfloat16, device=device),
        )
        for _ in range(cfg.n_layers)
    ]
    token = torch.zeros((batch, 1), dtype=torch.long, device=device)

    def step():
        cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layers])
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(plan["steps"]):
                _torch_call(reference, token, cache)
        _sync(device)
        return (time.perf_counter() - start) / plan["steps"]

    step()  # warm-up
    return median([step() for _ in range(plan["repeats"])])


def compressed_section(plan, models, bandwidth: float) -> list[dict]:
    """Decode step time at the longest context and largest batch under each policy (caches filled with
    random tokens, then compressed): against the full cache, and against what their bytes predict."""
    shape = list(models)[-1]
    model = models[shape][0]
    cfg, (_, weight_bytes) = model.config, _params(model)
    context, batch = max(plan["contexts"]), max(plan["batches"])
    room = -(-(plan["steps"] + 2) // 64) * 64
    lengths = np.full((batch,), context, np.int32)
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    gen = Generator(model, capacity=context + room)
    full = _filled(cfg, batch, context, room)
    base = _step_time(gen, full, logits, lengths, plan["steps"], plan["repeats"])
    full_bytes = caches_nbytes(full)
    rows = [dict(shape=shape, policy="full", step_ms=base * 1e3, vs_full=1.0, bytes_predict=1.0)]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64))
    for text in plan["policies"]:
        policy = parse_policy(text)
        caches = compressed(model, full, lengths, room, policy, tokens)
        step = _step_time(
            Generator(model, capacity=context + room, policy=policy),
            caches,
            logits,
            lengths,
            plan["steps"],
            plan["repeats"],
        )
        predict = (weight_bytes + caches_nbytes(caches)) / (weight_bytes + full_bytes)
        rows.append(dict(shape=shape, policy=text, step_ms=step * 1e3, vs_full=step / base, bytes_predict=predict))
    del full, bandwidth
    return rows


def engine_section(plan, models) -> list[dict]:
    """kvjax.Engine on the first shape: `requests` random requests (prompts 64-512 tokens, 32-128 new), all
    admitted at once; tokens/s of the second pass (the first compiles)."""
    shape = list(models)[0]
    model = models[shape][0]
    rng = np.random.default_rng(0)
    requests = [
        Request(
            tuple(int(t) for t in rng.integers(0, model.config.vocab_size, rng.integers(8, 33))),
            DecodingConfig(max_new_tokens=int(rng.integers(4, 17))),
        )
        for _ in range(plan["requests"])
    ]
    engine = Engine(model, n_pages=plan["requests"] * 4 + 1, page_size=16, slots=plan["requests"], max_tokens=64)
    engine.run(requests)
    engine.reset()
    start = time.perf_counter()
    engine.run(requests)
    seconds = time.perf_counter() - start
    new = sum(r.decoding.max_new_tokens for r in requests)
    return [dict(shape=shape, requests=len(requests), tok_s=new / seconds, peak_pages=engine.stats.peak_pages)]


def train_section(plan, peak: float) -> list[dict]:
    """Training tokens/s and MFU of the plan's training shape (random tokens from the KJV corpus)."""
    from kvjax.training.trainer import Trainer

    shape, batch, seq = plan["train"]
    cfg = kvjax_config(shape)
    config = Config(
        model=cfg,
        data=DataConfig(corpus="kjv", seq_len=seq, eval_windows=1),
        train=TrainConfig(
            steps=plan["steps"] + 2,
            batch_size=batch,
            warmup_steps=1,
            eval_every=10**9,
            checkpoint_every=10**9,
            log_every=1,
            master_dtype="float32",  # mixed precision: fp32 master weights, bf16 compute
        ),
    )
    with tempfile.TemporaryDirectory() as where:
        trainer = Trainer(config, where, progress=False)
        history = trainer.run()
    rate = float(np.median([row["tokens_per_s"] for row in history[2:]]))
    n_params, _ = _params(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    att = cfg.attention
    flops_per_token = 6 * n_params + 12 * cfg.n_layers * seq * att.n_heads * att.head_dim
    return [dict(shape=shape, batch=batch, seq_len=seq, tok_s=rate, mfu=rate * flops_per_token / peak)]


def memory_section(plan) -> list[dict]:
    """`kvjax memory --compiled` on the device: XLA's memory analysis of the prefill chunk and the decode
    of each shape at each context, compiled for this device from abstract inputs, against the budget."""
    from kvjax import footprint

    rows = []
    for shape in plan["shapes"]:
        cfg = kvjax_config(shape)
        model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # noqa: B023 (called at once)
        for context in plan["memory"]:
            chunk = min(2048, context)
            analysed = footprint.compiled(model, 1, context, chunk)
            for budget, got in zip(footprint.budgets(model, 1, context, chunk), analysed):
                rows.append(
                    dict(
                        shape=shape,
                        context=context,
                        program=got.program,
                        budget_gib=budget.total / 2**30,
                        compiled_peak_gib=got.peak / 2**30,
                        temps_gib=got.temporaries / 2**30,
                        caches_in_place=got.aliased >= budget.caches,
                    )
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="toy shapes, for a CPU (what the test suite runs)")
    parser.add_argument("--out", default="runs/accelerator", help="where results.json and results.md go")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="these sections (device always runs)")
    args = parser.parse_args(argv)
    plan = PLANS["tiny" if args.tiny else "full"]
    torch_device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    wanted = set(args.only or SECTIONS) | {"device"}
    results, start = {}, time.perf_counter()

    def section(name, fn, *a):
        if name not in wanted:
            return None
        began = time.perf_counter()
        try:
            results[name] = fn(*a)
        except Exception as e:  # one section's failure is a finding, not the end of the run
            results[name] = [dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])]
        print(f"{name}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        return results[name]

    device = section("device", device_section, plan)[0]
    bandwidth, peak = device["hbm_gb_s"] * 1e9, device["matmul_tflops"] * 1e12
    section("parity", parity_section, plan, torch_device)
    section("memory", memory_section, plan)
    models = {}
    if wanted & {"prefill", "decode", "compressed", "engine"}:
        models = {s: (Decoder(kvjax_config(s), rngs=nnx.Rngs(0)), torch_model(s, torch_device)) for s in plan["shapes"]}
    section("prefill", prefill_section, plan, models, peak, torch_device)
    section("decode", decode_section, plan, models, bandwidth, torch_device)
    section("compressed", compressed_section, plan, models, bandwidth)
    section("engine", engine_section, plan, models)
    section("train", train_section, plan, peak)
    results["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 1 if any("error" in row for rows in results.values() if isinstance(rows, list) for row in rows) else 0


def markdown(results: dict) -> str:
    """Every section as a table of its rows (floats to 3 significant digits; tracebacks left to the JSON)."""
    lines = [f"# kvjax on {results['device'][0].get('device', '?')} ({results['seconds']:.0f} s)", ""]
    for name in SECTIONS:
        rows = results.get(name)
        if not rows:
            continue
        head = [k for k in rows[0] if k != "traceback"]
        body = [[f"{r.get(k):.3g}" if isinstance(r.get(k), float) else r.get(k) for k in head] for r in rows]
        lines += [f"## {name}", "", format_table(head, body), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

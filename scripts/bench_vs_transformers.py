"""Prefill and decode throughput of one model in kvjax and in Hugging Face transformers (PyTorch, CPU),
measured in the same run on the same weights: a shipped model (smollm2, gemma3) or .gguf file (transformers
dequantizes it itself), or a Hugging Face checkpoint directory. Needs the `parity` extra.

    python scripts/bench_vs_transformers.py [--model smollm2] [--context 2048] [--batches 1 8] [--new-tokens 16]
        [--nll-windows 4]

`--nll-windows N` also scores N held-out KJV windows of `--context` tokens (the model's own tokenizer;
BOS first where the model's file asks for it) on both sides: mean NLL in nats per token, which should
agree to the last few digits when both read the same weights.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import torch

from kvjax.commands import user_errors
from kvjax.report import format_table
from kvjax.timing import generation_times
from kvjax.training.compression_eval import corpus_tokens
from kvjax.training.gguf_import import resolve_gguf
from kvjax.training.loading import is_gguf, load_decoder, load_model


@torch.no_grad()
def torch_speeds(model, prompts: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, float]:
    """transformers at its best on CPU: SDPA attention, its current cache API (`cache=`), logits for the
    last prompt token only (`logits_to_keep=1`, as its `generate` does), one full-size warm-up round,
    then the median of `repeats` rounds."""
    ids = torch.tensor(prompts)
    prefills, decodes = [], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        prefills.append(time.perf_counter() - start)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        decodes.append(time.perf_counter() - start)
    return prompts.size / np.median(prefills[1:]), len(prompts) * (new_tokens - 1) / np.median(decodes[1:])


def reference_model(ref: str):
    """transformers' model of the same checkpoint, fp32, with SDPA attention where the architecture has it
    (Gemma 2's soft-capped logits need the eager path); returns the model and the attention it runs."""
    import transformers

    if is_gguf(ref):
        path = resolve_gguf(ref)
        where, kwargs = str(path.parent), {"gguf_file": path.name}
    else:
        where, kwargs = ref, {}
    for attention in ("sdpa", "eager"):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                where, dtype=torch.float32, attn_implementation=attention, **kwargs
            )
            return model.eval(), attention
        except ValueError:  # the architecture has no SDPA path
            continue
    raise SystemExit(f"transformers cannot load {ref}")


def nll(logits: np.ndarray, windows: np.ndarray) -> float:
    """Mean next-token NLL (nats) of windows `[n, L]` from logits `[n, L, V]` (fp32)."""
    logits = logits[:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, windows[:, 1:, None], -1)[..., 0]
    return float((logz - picked).mean())


def nll_both(loaded, reference, windows: int, length: int) -> tuple[float, float]:
    """(kvjax, transformers) mean NLL over `windows` KJV validation windows of `length` tokens;
    `loaded`: kvjax's model with its tokenizer (`load_model`)."""
    model = loaded.model
    stream = corpus_tokens(loaded.tokenizer, "kjv")
    rows = np.resize(stream, (windows, length)).astype(np.int64)
    if loaded.bos:
        rows[:, 0] = loaded.tokenizer.bos_id
    ours, theirs = [], []
    forward = jax.jit(lambda t, p: model(t, p)[0])
    for row in rows:
        ours.append(nll(np.asarray(forward(row[None].astype(np.int32), np.arange(length)[None])), row[None]))
        with torch.no_grad():
            theirs.append(nll(reference(torch.tensor(row[None])).logits.numpy(), row[None]))
    return float(np.mean(ours)), float(np.mean(theirs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3, a .gguf file or a Hugging Face directory")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens + new tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per side (median), after a warm-up")
    parser.add_argument("--nll-windows", type=int, default=0, help="held-out KJV windows scored on both sides")
    args = parser.parse_args()

    import transformers

    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        loaded = load_model(args.model) if args.nll_windows else None  # the NLL needs the tokenizer too
        model = loaded.model if loaded else load_decoder(args.model)[1]
    except user_errors() as e:  # a wrong --model: one line, as the kvjax commands say it
        raise SystemExit(f"bench_vs_transformers.py: error: {e}") from None
    reference, attention = reference_model(args.model)
    rows = []
    rng = np.random.default_rng(0)
    for batch in args.batches:
        prompts = rng.integers(3, model.config.vocab_size, (batch, args.context - args.new_tokens))
        prefill_s, decode_s, _ = generation_times(model, prompts, args.new_tokens, repeats=args.repeats)
        ours = (prompts.size / prefill_s, batch * (args.new_tokens - 1) / decode_s)
        theirs = torch_speeds(reference, prompts, args.new_tokens, args.repeats)
        rows.append(
            [
                batch,
                f"{ours[0]:,.0f}",
                f"{theirs[0]:,.0f}",
                f"{ours[0] / theirs[0]:.2f}x",
                f"{ours[1]:,.1f}",
                f"{theirs[1]:,.1f}",
                f"{ours[1] / theirs[1]:.2f}x",
            ]
        )
    print(
        f"{model.config.name}, fp32, context {args.context}, jax {jax.__version__}, torch {torch.__version__}, "
        f"transformers {transformers.__version__} ({attention}), {torch.get_num_threads()} torch threads"
    )
    print(
        format_table(
            ["batch", "prefill tok/s kvjax", "transformers", "ratio", "decode tok/s kvjax", "transformers", "ratio"],
            rows,
        )
    )
    if args.nll_windows:
        ours, theirs = nll_both(loaded, reference, args.nll_windows, args.context)
        print(
            f"NLL over {args.nll_windows} KJV validation windows of {args.context} tokens: kvjax {ours:.6f}, "
            f"transformers {theirs:.6f} nats/token (|diff| {abs(ours - theirs):.2e})"
        )


if __name__ == "__main__":
    main()

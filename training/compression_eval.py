"""How much a compressed cache costs in quality, speed and memory.

- Continuation: compress a prefix of real text, then score the next tokens by teacher forcing (NLL in
  nats per token, perplexity) and compare each next-token distribution with the full cache's (KL
  divergence, nats). This is kvpress's protocol (a 1.5k-token prefix of a text, the next 255 tokens):
  the token right after the prefix is read but not scored, since the prefill predicts it before any
  compression (the same for every policy); each scored token is predicted through the compressed cache.
- Synthetic retrieval built from corpus filler text, scored by exact match of a greedy answer:
  passkey retrieval (Mohtashami and Jaggi 2023) and multi-key needle in a haystack (RULER's
  niah_multikey: several "special magic number" needles, one asked for), at several lengths and depths.
- Decode speed after a compressed prefill, and the cache bytes each policy stores.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.compress import (
    Policy,
    compressed_cache_bytes,
    parse_policy,
    plan_stages,
    prepare_policy,
)
from kvjax.config import DecodingConfig
from kvjax.generate import Generator
from kvjax.memory import cache_bytes
from kvjax.quality import kl_per_position
from kvjax.report import format_table
from kvjax.timing import decode_rounds
from kvjax.training.data import DataError, load_corpus, split_documents
from kvjax.training.retrieval import answered, needle_case, passkey_case
from kvjax.training.tokenizer import Tokenizer

TASKS = ("continuation", "passkey", "needle")
ANSWER_TOKENS = 10  # tokens generated for a passkey / needle answer


def _policy(policy: str | Policy | None) -> Policy | None:
    return parse_policy(policy) if isinstance(policy, str) else policy


def corpus_tokens(
    tokenizer: Tokenizer,
    corpus: str = "kjv",
    val_fraction: float = 0.1,
    split: str = "val",
    max_docs: int | None = None,
) -> np.ndarray:
    """The validation (or training) documents of a corpus as one token stream (joined by blank lines)."""
    train, val = split_documents(load_corpus(corpus), val_fraction)
    docs = val if split == "val" else train
    return np.asarray(tokenizer.encode("\n\n".join(d.text for d in docs[:max_docs])), np.int32)


def calibration_tokens(tokenizer: Tokenizer, corpus: str = "kjv", rows: int = 8, length: int = 256) -> np.ndarray:
    """`[rows, length]` tokens of the corpus's training split, for calibrating low-rank (Palu) bases."""
    stream = corpus_tokens(tokenizer, corpus, split="train", max_docs=4)
    if len(stream) < rows * length:
        raise DataError(f"calibration needs {rows * length} training tokens; the corpus has {len(stream)}")
    return stream[: rows * length].reshape(rows, length)


def continuation_windows(stream: np.ndarray, prefix: int, continuation: int, samples: int, bos_id: int | None = None):
    """`samples` non-overlapping (prefix `[n,P]`, continuation `[n,N+1]`) slices of a token stream, for
    N = `continuation` scored tokens after the unscored first one (see the module docstring); with
    `bos_id` each prefix starts with BOS instead of its first token (as models trained here saw text)."""
    span = prefix + continuation + 1
    if prefix < 1 or continuation < 1 or samples < 1:
        raise ValueError(f"prefix={prefix}, continuation={continuation} and samples={samples} must be >= 1")
    if len(stream) < span * samples:
        raise DataError(f"the text has {len(stream)} tokens; {samples} samples of {span} need {span * samples}")
    windows = stream[: span * samples].reshape(samples, span).copy()
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows[:, :prefix], windows[:, prefix:]


@dataclasses.dataclass
class ContinuationScore:
    policy: str
    nll: float  # nats per continuation token
    ppl: float
    kl: float  # mean KL(full || compressed) of the next-token distributions, nats
    cache_bytes_per_token: float  # stored cache bytes per prefix token right after compression


def kl_divergence(full_logp: np.ndarray, logp: np.ndarray) -> float:
    """Mean over positions of KL(p_full || p), from log-distributions `[..., V]`."""
    return float(np.mean(kl_per_position(full_logp, logp)))


def stored_bytes_per_token(model, policy: Policy | None, prefix: int, layer_counts=None) -> float:
    """Cache bytes of one sequence right after a `prefix`-token prefill (and compression), per token;
    D2O's budgets depend on the prompt: pass the ones its Generator planned (`layer_counts`, `[n, 1]`)."""
    cfg = model.config
    if policy is None:
        return cache_bytes(cfg, prefix) / prefix
    prepared = prepare_policy(policy, model, shapes_only=True)  # what sizes the caches (LoRC's ranks, Duo's heads)
    if layer_counts is not None:  # a layer never keeps more than the prefix it was given
        layer_counts = np.minimum(layer_counts, prefix)
    plans = plan_stages(cfg, policy.stages, [prefix], headroom=0, layer_counts=layer_counts, **prepared)
    return compressed_cache_bytes(cfg, plans, 1, prefix) / prefix


def continuation_eval(
    model, prefixes, continuations, policies, *, batch: int = 1, calibration=None, on_batch=None
) -> list[ContinuationScore]:
    """Score each policy (None = the full cache, always scored first as the reference) on continuations
    `[n,N+1]` from `continuation_windows`: tokens 1..N, each predicted through the compressed cache;
    `calibration` tokens calibrate Palu policies. `on_batch(rows)` follows each batch of rows scored."""
    P, N = prefixes.shape[1], continuations.shape[1]

    def score(policy):
        gen = Generator(model, capacity=P + N, policy=policy, calibration=calibration)
        logps, fulls = [], []
        for i in range(0, len(prefixes), batch):
            logp, full = gen.score(
                prefixes[i : i + batch].tolist(), continuations[i : i + batch].tolist(), keep_logits=True
            )
            logps.append(logp[:, 1:])  # the first was predicted by the prefill, before compression
            fulls.append(full[:, 1:])
            if on_batch is not None:
                on_batch(len(logp))
        counts = None if gen.layer_counts is None else gen.layer_counts[:, :1]  # D2O: the last prompt's
        return np.concatenate(logps), np.concatenate(fulls), counts

    ref_logp, ref_full, _ = score(None)
    rows = [
        ContinuationScore(
            "full",
            float(-ref_logp.mean()),
            float(np.exp(-ref_logp.mean())),
            0.0,
            stored_bytes_per_token(model, None, P),
        )
    ]
    for text in policies:
        policy = _policy(text)
        logp, full, counts = score(policy)
        rows.append(
            ContinuationScore(
                str(policy),
                float(-logp.mean()),
                float(np.exp(-logp.mean())),
                kl_divergence(ref_full, full),
                stored_bytes_per_token(model, policy, P, counts),
            )
        )
    return rows


def retrieval_accuracy(
    model,
    tokenizer,
    task: str,
    lengths,
    depths,
    *,
    policy=None,
    trials: int = 4,
    bos: bool = False,
    filler: np.ndarray | None = None,
    seed: int = 0,
    calibration=None,
    on_cell=None,
) -> dict[tuple[int, float], float]:
    """Exact-match accuracy of greedy answers {(length, depth): fraction of `trials`}; `on_cell()` follows
    each (length, depth)."""
    if task not in ("passkey", "needle"):
        raise ValueError(f"task={task!r} must be 'passkey' or 'needle'")
    filler = corpus_tokens(tokenizer) if filler is None else filler
    make = passkey_case if task == "passkey" else needle_case
    rng = np.random.default_rng(seed)
    decoding = DecodingConfig(max_new_tokens=ANSWER_TOKENS)
    out = {}
    for length in lengths:
        gen = Generator(
            model, capacity=length + decoding.max_new_tokens, policy=_policy(policy), calibration=calibration
        )
        for depth in depths:
            cases = [make(tokenizer, filler, length, depth, rng, bos) for _ in range(trials)]
            result = gen([c.prompt for c in cases], decoding)
            hits = [answered(tokenizer, result.tokens[i, : result.lengths[i]], c.answer) for i, c in enumerate(cases)]
            out[(length, depth)] = float(np.mean(hits))
            if on_cell is not None:
                on_cell()
    return out


# --- speed -----------------------------------------------------------------------------------------


def decode_seconds_per_step(
    model, context: int, batch: int, policy=None, new_tokens: int = 16, calibration=None
) -> float:
    """Greedy decode time per step after a (compressed) prefill of `context - new_tokens` random tokens,
    one round timed after one that compiles."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, model.config.vocab_size, (batch, context - new_tokens)).tolist()
    gen = Generator(model, capacity=context, policy=_policy(policy), calibration=calibration)
    lengths, logits, caches, stats = gen.start(prompts, new_tokens)
    seconds, _ = decode_rounds(gen, logits, caches, lengths, new_tokens, repeats=1, stats=stats)
    return seconds[0] / (new_tokens - 1)


# --- the policy table of `kvjax compare --policy` ------------------------------------------------


@dataclasses.dataclass
class PolicyRow:
    policy: str
    ratio: float | None  # kvpress's compression ratio, the fraction of the prefix removed (None: as given)
    cache_bytes_per_token: float
    nll: float
    kl: float
    passkey: float | None
    decode_tokens_per_s: float


def with_budget(method: str, ratio: float) -> str:
    """'snapkv' or 'snapkv:obs_window=16' (options without a budget) at a ratio: 'snapkv:0.5[:...]'."""
    name, _, options = method.partition(":")
    return f"{name}:{ratio:g}" + (f":{options}" if options else "")


def has_budget(entry: str) -> bool:
    """Whether a `--policy` entry is a whole policy ('kivi:2', 'snapkv:0.5+kivi:4'), run as given,
    rather than a method to run at every budget ('snapkv', 'snapkv:obs_window=16')."""
    parts = entry.split(":")
    if "+" in entry or len(parts) < 2:
        return "+" in entry
    try:
        float(parts[1])
    except ValueError:
        return False
    return True


def table_runs(entries, ratios) -> list[tuple[str | None, float | None]]:
    """(policy, compression ratio or None) for each row of the policy table, the full cache first: each
    method at every ratio (the fraction removed, as a policy's budget below 1 counts it), each whole
    policy as given."""
    runs = [(None, None)]
    for entry in entries:
        runs += [(entry, None)] if has_budget(entry) else [(with_budget(entry, r), r) for r in ratios]
    return runs


def policy_table(
    model,
    tokenizer,
    methods,
    ratios,
    *,
    prefix: int,
    continuation: int,
    samples: int = 1,
    context: int,
    decode_batch: int = 1,
    passkey_length: int | None = None,
    trials: int = 4,
    bos: bool = False,
    log=print,
    calibration=None,
    corpus: str = "kjv",
) -> list[PolicyRow]:
    """Every method at every compression ratio (fraction removed), and every whole policy as given (`kivi:2`):
    continuation NLL / KL on the corpus's validation text, cache bytes per token, passkey accuracy (if
    passkey_length) and decode speed at `context` tokens."""
    stream = corpus_tokens(tokenizer, corpus)
    prefixes, conts = continuation_windows(stream, prefix, continuation, samples, tokenizer.bos_id if bos else None)
    runs = table_runs(methods, ratios)
    scores = continuation_eval(model, prefixes, conts, [text for text, _ in runs[1:]], calibration=calibration)
    rows = []
    for (text, ratio), score in zip(runs, scores):
        log(f"  {score.policy}: NLL {score.nll:.4f}, KL {score.kl:.4f}")
        acc = None
        if passkey_length:
            accs = retrieval_accuracy(
                model,
                tokenizer,
                "passkey",
                [passkey_length],
                [0.1, 0.5, 0.9],
                policy=text,
                trials=trials,
                bos=bos,
                filler=stream,
                calibration=calibration,
            )
            acc = float(np.mean(list(accs.values())))
        step = decode_seconds_per_step(model, context, decode_batch, text, calibration=calibration)
        rows.append(
            PolicyRow(score.policy, ratio, score.cache_bytes_per_token, score.nll, score.kl, acc, decode_batch / step)
        )
    return rows


def render_policy_table(rows: list[PolicyRow], title: str) -> str:
    head = ["policy", "ratio", "cache B/token", "NLL (nats)", "KL vs full", "passkey", "decode tok/s"]
    body = [
        [
            r.policy,
            "-" if r.ratio is None else f"{r.ratio:g}",
            f"{r.cache_bytes_per_token:,.0f}",
            f"{r.nll:.4f}",
            f"{r.kl:.4g}",
            "-" if r.passkey is None else f"{r.passkey:.2f}",
            f"{r.decode_tokens_per_s:,.1f}",
        ]
        for r in rows
    ]
    return title + "\n" + format_table(head, body)

"""What a compressed cache costs in quality: KL(full || compressed) of the next-token distributions along
given continuations, each scored teacher-forced through `Generator.score` with and without the policy
(the measure `kvjax eval` reports, here for the continuations a server actually produced)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.compress import parse_policy
from kvjax.generate import Generator

LOGITS_BYTES = 2**30  # host memory one scored batch's fp32 log-distributions may take (each side)


def kl_per_position(full_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(p_full || p) at every position, from log-distributions `[..., V]` (nats, shape `[...]`)."""
    return np.sum(np.exp(full_logp) * (full_logp - logp), axis=-1)


@dataclasses.dataclass(frozen=True)
class ContinuationKL:
    policy: str
    kl: float  # mean over the scored positions, nats per token
    kl_max: float  # the largest one position reached
    positions: int  # tokens scored: every continuation token but the first (the prefill predicts it)


def continuation_kl(
    model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], policy: str, calibration=None
) -> ContinuationKL:
    """KL(full || `policy`) along each prompt's continuation. The first token of a continuation is
    predicted by the prefill before anything is compressed, so it is not counted. Continuations of
    different lengths are padded to a power of two and the padding is masked: a position's distribution
    depends only on the tokens before it (decode-time eviction too fires on what came before), so the
    padding changes nothing that is counted. Rows go in batches whose log-distributions fit LOGITS_BYTES,
    the last batch filled with copies of its first row, so each padded length compiles once. `calibration`:
    tokens the policy learns from (Palu's bases)."""
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError("continuation_kl needs one continuation per prompt, and at least one prompt")
    if min(len(c) for c in continuations) < 1:
        raise ValueError("every continuation needs at least one token")
    order = sorted(range(len(prompts)), key=lambda i: len(continuations[i]))
    longest = max(len(c) for c in continuations)
    width = 1 << (longest - 1).bit_length()
    capacity = max(len(p) for p in prompts) + width
    full = Generator(model, capacity=capacity)
    compressed = Generator(model, capacity=capacity, policy=parse_policy(policy), calibration=calibration)
    rows = max(1, min(len(order), LOGITS_BYTES // (width * model.config.vocab_size * 4)))
    total = top = 0.0
    count = 0
    for start in range(0, len(order), rows):
        group = order[start : start + rows]
        group += [group[0]] * (rows - len(group))
        n = 1 << (max(len(continuations[i]) for i in group) - 1).bit_length()
        batch_prompts = [list(prompts[i]) for i in group]
        padded = [list(continuations[i]) + [0] * (n - len(continuations[i])) for i in group]
        _, ref = full.score(batch_prompts, padded, keep_logits=True)
        _, got = compressed.score(batch_prompts, padded, keep_logits=True)
        kl = kl_per_position(ref, got)
        for row, i in enumerate(group[: len(order) - start]):
            counted = kl[row, 1 : len(continuations[i])]
            total += float(counted.sum())
            top = max(top, float(counted.max(initial=0.0)))
            count += counted.size
    return ContinuationKL(policy, total / count if count else 0.0, top, count)

"""Scorers: how much each cached slot matters, `[B,Kh,S]` aligned with the cache's slots. Each scoring
method lives in its own module under `kvjax.compress.methods` (StreamingLLM, H2O, SnapKV, TOVA, key
norm, Scissorhands, D2O's scoring, ThinK's observation); these functions look the stage's method up."""

from __future__ import annotations

import jax

from kvjax.compress.methods import METHODS
from kvjax.compress.policy import Stage


def observed_queries(stage: Stage, length: int) -> int:
    """How many of the last prompt queries a stage observes (0: none; `length`: all)."""
    method = METHODS.get(stage.method)
    return 0 if method is None else method.observed_queries(stage, length)


def observe(stage: Stage, probs, obs_pos, pooled: bool, visible=None, queries=None):
    """The stage's statistic of observed attention (see `Method.observe`), or None."""
    method = METHODS.get(stage.method)
    return None if method is None else method.observe(stage, probs, obs_pos, pooled, visible, queries)


def score(stage: Stage, cache, stat: jax.Array | None, last_pos: jax.Array) -> jax.Array:
    """Scores `[B,Kh,S]` of a cache's slots (KVCache, PooledKVCache or LatentCache)."""
    method = METHODS[stage.method]
    if stat is None and method.observed_queries(stage, 1):
        raise ValueError(f"scorer {stage.method!r} needs an attention observation")
    return method.score(stage, cache, stat, last_pos)


def additive(stage: Stage) -> bool:
    """Whether the stage's statistic (if any) is a sum over the observed queries (`Method.additive`)."""
    method = METHODS.get(stage.method)
    return method is None or not method.observed_queries(stage, 2) or method.additive


def accumulates(stage: Stage) -> bool:
    """Whether the stage's decode-time statistic adds up over steps (H2O's attention sums)."""
    method = METHODS.get(stage.method)
    return method is not None and method.accumulates


def needs_visibility(stages) -> bool:
    """Whether a stage's observation counts the keys each query could see (Scissorhands' 1/n)."""
    return any(getattr(METHODS.get(stage.method), "counts_visible", False) for stage in stages)

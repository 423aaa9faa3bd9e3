"""A LongBench sweep (`kvjax.training.sweeps` runs it): every (task, policy, sample) cell answered greedily
through the policy's cache and scored with the task's official metric (`kvjax.training.longbench`); the
context compressed alone (kvpress's protocol) or with its question. v2's accuracy is also broken down by
difficulty and length, as LongBench v2's `result.py` does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from kvjax.report import format_table
from kvjax.training import longbench
from kvjax.training.loading import weights_digest
from kvjax.training.sweeps import Item, Run, Sweep
from kvjax.training.sweeps import sweep as sweep_items

VERSION = 1  # raised whenever kvjax's prompts or metrics change the cells of a sweep


def prompt_parts(
    sample: longbench.Sample, tokenizer, bos: bool, max_length: int, split: bool = True
) -> tuple[list[int], list[int]]:
    """(context, question) token ids: BOS, the chat turn's start (where LongBench uses the chat template)
    and the context cut in the middle to fit `max_length` with the question; then the question, its
    instructions and answer prefix and the turn's end. `split=False`: all of it as the context."""
    turn = getattr(tokenizer, "chat_turn", lambda: None)() if longbench.chat(sample.task) else None
    start, end = turn or ("", "")
    question = tokenizer.encode(sample.question + end)
    context = longbench.truncate(
        ([tokenizer.bos_id] if bos else []) + tokenizer.encode(start + sample.context), question, max_length
    )
    return (context, question) if split else (context + question, [])


def identity(model, tokenizer, *, bos: bool, query_aware: bool) -> dict:
    """What decides a sweep's answers besides each cell's input: the model (name, weights digest), the
    template (chat turns or plain, BOS), the question mode and kvjax's LongBench version."""
    chat = getattr(tokenizer, "chat_turn", lambda: None)() is not None
    return dict(
        model=model.config.name,
        weights=weights_digest(model),
        template=("chat" if chat else "plain") + ("+bos" if bos else ""),
        query_aware=query_aware,
        generator=VERSION,
    )


def sweep(
    model,
    tokenizer,
    *,
    bos: bool,
    samples: dict[str, list[longbench.Sample]],
    max_length: int,
    runs_: list[Run],
    results: Path,
    query_aware: bool = False,
    calibration=None,
    share: bool = True,
    on_cell: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> Sweep:
    """Every cell's record for each task's `samples` (`longbench.load`: read, and checked, before anything
    runs), read back from `results` or computed and appended to it (resumable; a file of another sweep
    refused before any compute). Prompts fit `max_length` tokens (the table's length column); each task
    generates its own budget. See `kvjax.training.ruler_eval.sweep` for the
    question modes, `share` and `stop`."""
    ident = identity(model, tokenizer, bos=bos, query_aware=query_aware)
    budget = max(longbench.max_new_tokens(t) for t in samples)  # one capacity: one compile per policy
    items = []
    for task, task_samples in samples.items():
        for sample in task_samples:
            context, question = prompt_parts(sample, tokenizer, bos, max_length, split=not query_aware)
            new = longbench.max_new_tokens(task)
            items.append(
                Item(task, max_length, sample.index, context, question, new, _scorer(sample), max_length + budget)
            )
    return sweep_items(
        model, tokenizer, items, runs_, results, ident, calibration=calibration, share=share, on_cell=on_cell, stop=stop
    )


def _scorer(sample: longbench.Sample) -> Callable[[str], dict]:
    """An answer's record fields: the references, the score, and v2's choice read and categories."""

    def fields(answer: str) -> dict:
        out = {"answers": list(sample.answers), "score": longbench.score(sample, answer)}
        if sample.task == longbench.V2:
            out |= {"choice": longbench.extract_choice(answer), "difficulty": sample.difficulty, "size": sample.size}
        return out

    return fields


def v2_table(records: list[dict]) -> str:
    """LongBench v2's breakdown: per policy, accuracy (%) overall, by difficulty and by length, with the
    questions in each (empty where a sweep has none of them)."""
    rows = []
    mine = [r for r in records if r["task"] == longbench.V2]
    for policy in dict.fromkeys(r["policy"] for r in mine):
        cells = [r for r in mine if r["policy"] == policy]
        parts = [cells] + [[r for r in cells if r.get(k) == v] for k, v in _GROUPS]
        rows.append(
            [policy, *(f"{100 * sum(r['score'] for r in p) / len(p):.1f} ({len(p)})" if p else "" for p in parts)]
        )
    if not rows:
        return ""
    return format_table(["policy", "overall", *(v for _, v in _GROUPS)], rows)


_GROUPS = (("difficulty", "easy"), ("difficulty", "hard"), ("size", "short"), ("size", "medium"), ("size", "long"))

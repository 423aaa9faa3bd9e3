"""A RULER sweep (`kvjax.training.sweeps` runs it): every (task, length, policy, sample) cell answered
greedily through the policy's cache and scored with RULER's string match; the samples are generated
before the first cell, the context compressed alone (kvpress's protocol) or with its question."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from kvjax.training import ruler
from kvjax.training.loading import weights_digest
from kvjax.training.sweeps import Item, Run, Sweep
from kvjax.training.sweeps import sweep as sweep_items


def prompt_ids(sample: ruler.Sample, tokenizer, bos: bool) -> list[int]:
    """The model's input: RULER's plain template for a base model (input, then the answer prefix), the
    user turn of its chat template around the input for a chat model, the answer prefix after it."""
    return sum(prompt_parts(sample, tokenizer, bos, split=False), [])


def prompt_parts(sample: ruler.Sample, tokenizer, bos: bool, split: bool = True) -> tuple[list[int], list[int]]:
    """The model's input as (context, question) token ids: the context up to where the question begins
    (`ruler.question_at`), then the question, the chat turn's end and the answer prefix, each part
    tokenized alone as kvpress's pipeline does; `split=False`: the whole input as one part and nothing."""
    chat = getattr(tokenizer, "chat_turn", lambda: None)() or ("", "")
    at = ruler.question_at(sample) if split else len(sample.input)
    context = ([tokenizer.bos_id] if bos else []) + tokenizer.encode(chat[0] + sample.input[:at])
    question = sample.input[at:] + chat[1] + sample.answer_prefix
    return context, tokenizer.encode(question) if question else []


def template_tokens(tokenizer, bos: bool) -> int:
    """Tokens the chat template and BOS add around a sample (RULER's `model_template_token`)."""
    chat = getattr(tokenizer, "chat_turn", lambda: None)()
    return int(bos) + (0 if chat is None else len(tokenizer.encode(chat[0] + chat[1])))


def identity(model, tokenizer, *, bos: bool, seed: int, essay: str, query_aware: bool) -> dict:
    """What decides a sweep's answers besides each cell's own input: the model (its name and a digest of its
    weights), the generation seed, the essay haystack's text, the prompt template (plain or the model's chat
    turn, BOS or not), whether the policies compress with the question in view and the generators' version
    (`ruler.VERSION`)."""
    chat = getattr(tokenizer, "chat_turn", lambda: None)() is not None
    return dict(
        model=model.config.name,
        weights=weights_digest(model),
        seed=seed,
        haystack=essay,
        template=("chat" if chat else "plain") + ("+bos" if bos else ""),
        query_aware=query_aware,
        generator=ruler.VERSION,
    )


def sweep(
    model,
    tokenizer,
    *,
    bos: bool,
    tasks: list[str],
    lengths: list[int],
    samples: int,
    runs_: list[Run],
    results: Path,
    seed: int = 42,
    essay: str | None = None,
    query_aware: bool = False,
    calibration=None,
    qa_files: dict | None = None,
    share: bool = True,
    on_cell: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> Sweep:
    """Every cell's record, read back from `results` (a JSONL file) or computed and appended to it
    (`kvjax.training.sweeps.sweep`: resumable, a file of another sweep refused before any compute). Every
    sample is generated before the first cell, so a length too short fails before anything is written.
    `query_aware`: compress the whole input (context, question, answer prefix), else the context alone, the
    question fed after it (`Generator.answer`, kvpress's leaderboard protocol); `essay`: the essay
    haystacks' text (`ruler.ESSAYS`, default `ruler.default_essay()`); `qa_files`: the data file of each QA
    task asked for (`ruler.qa_tasks`). With `share`, the policies that compress once after the prefill
    share one observed prefill per sample; a set `stop` (Ctrl-C) ends the sweep after the sample in
    progress with `Interrupted`. Samples run index by index across the tasks (each task's first, then each
    one's second...), so a sweep stopped early has as many samples of every task, give or take one."""
    essay = ruler.check_essay(essay)
    ident = identity(model, tokenizer, bos=bos, seed=seed, essay=essay, query_aware=query_aware)
    template, files = template_tokens(tokenizer, bos), qa_files or {}
    items = []
    for length in lengths:
        generated = [
            ruler.generate(task, tokenizer, length, samples, seed, files.get(task), template, essay) for task in tasks
        ]
        for row in zip(*generated):  # sample 0 of every task, then sample 1...: a sweep stopped early stays even
            for task, sample in zip(tasks, row):
                context, question = prompt_parts(sample, tokenizer, bos, split=not query_aware)
                new = ruler.TASKS[task].tokens_to_generate  # RULER's budget of new tokens per task
                items.append(Item(task, length, sample.index, context, question, new, _scorer(sample)))
    return sweep_items(
        model, tokenizer, items, runs_, results, ident, calibration=calibration, share=share, on_cell=on_cell, stop=stop
    )


def _scorer(sample: ruler.Sample) -> Callable[[str], dict]:
    """An answer's record fields: the references and RULER's string-match score."""
    return lambda answer: {"outputs": list(sample.outputs), "score": ruler.score(answer, sample.outputs, sample.metric)}

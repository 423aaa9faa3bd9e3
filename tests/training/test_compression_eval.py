"""Evaluation of compressed caches: continuation NLL / KL, synthetic retrieval prompts, the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest

from kvjax.commands import main
from kvjax.training import compression_eval as ce
from kvjax.training import retrieval
from kvjax.training.tokenizer import ByteTokenizer
from tests.training.conftest import SMALL_CORPUS
from tests.training.test_cli import TINY


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("run") / "gqa")
    assert main(["train", "gqa", *TINY, "--run-dir", path]) == 0
    return path


def test_kl_divergence_is_zero_for_equal_distributions_and_matches_a_hand_value():
    p = np.log(np.array([[0.5, 0.5]]))
    q = np.log(np.array([[0.9, 0.1]]))
    assert ce.kl_divergence(p, p) == 0
    assert ce.kl_divergence(p, q) == pytest.approx(0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1))


def test_continuation_windows_are_consecutive_slices():
    stream = np.arange(100)
    prefixes, conts = ce.continuation_windows(stream, 10, 5, 3)  # 5 scored tokens after an unscored one
    np.testing.assert_array_equal(prefixes[1], np.arange(16, 26))
    np.testing.assert_array_equal(conts[2], np.arange(42, 48))
    with_bos, _ = ce.continuation_windows(stream, 10, 5, 3, bos_id=-1)
    np.testing.assert_array_equal(with_bos[:, 0], -1)
    np.testing.assert_array_equal(with_bos[1, 1:], np.arange(17, 26))
    with pytest.raises(ce.DataError, match="need 303"):
        ce.continuation_windows(stream, 90, 10, 3)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_and_needle_prompts_have_the_length_and_the_needle_at_its_depth(depth):
    tok = ByteTokenizer()
    filler = np.asarray(tok.encode("abcdefghij" * 200), np.int32)
    rng = np.random.default_rng(0)
    case = retrieval.passkey_case(tok, filler, 600, depth, rng, bos=True)
    assert len(case.prompt) == 600 and case.prompt[0] == tok.bos_id and len(case.answer) == 5
    text = tok.decode(case.prompt)
    needle = text.index(f"The pass key is {case.answer}.")
    head, tail = len(retrieval.INTRO) + 1, len("\nWhat is the pass key? The pass key is")
    fill = (
        600
        - 1
        - len(retrieval.INTRO)
        - tail
        - len(f" The pass key is {case.answer}. Remember it. {case.answer} is the pass key. ")
    )
    assert abs((needle - 1 - head + 1) - round(depth * fill)) <= 2
    assert text.endswith("The pass key is")
    multi = retrieval.needle_case(tok, filler, 800, depth, rng, bos=False)
    text = tok.decode(multi.prompt)
    assert len(multi.prompt) == 800 and text.count("special magic numbers for") == 4
    word = text.rsplit("special magic number for ", 1)[1].split()[0].rstrip("?")
    assert f"for {word} is: {multi.answer}." in text
    assert retrieval.answered(tok, tok.encode(f" {multi.answer}, yes"), multi.answer)
    assert not retrieval.answered(tok, tok.encode(" 12"), multi.answer)


def test_a_chat_model_gets_the_passkey_as_one_user_turn_with_the_reply_begun():
    class ChatBytes(ByteTokenizer):
        def chat_turn(self):
            return "<user>", "</user><assistant>"

    tok = ChatBytes()
    filler = np.asarray(tok.encode("abcdefghij" * 200), np.int32)
    case = retrieval.passkey_case(tok, filler, 500, 0.5, np.random.default_rng(0), bos=False)
    text = tok.decode(case.prompt)
    assert len(case.prompt) == 500 and text.startswith("<user>Read the text and tell me the secret number.")
    assert text.endswith("What is the secret number?</user><assistant>The secret number is")
    assert f"\nThe secret number is {case.answer}.\n" in text


def test_with_budget_inserts_the_ratio_before_the_options():
    assert ce.with_budget("snapkv", 0.5) == "snapkv:0.5"
    assert ce.with_budget("snapkv:obs_window=16", 0.75) == "snapkv:0.75:obs_window=16"
    runs = ce.table_runs(["snapkv", "kivi:2", "snapkv:0.5+int:8", "h2o:normalize=true"], [0.75, 0.5])
    assert runs == [  # a ratio is the fraction removed, the policy's own budget
        (None, None),
        ("snapkv:0.75", 0.75),
        ("snapkv:0.5", 0.5),
        ("kivi:2", None),
        ("snapkv:0.5+int:8", None),
        ("h2o:0.75:normalize=true", 0.75),
        ("h2o:0.5:normalize=true", 0.5),
    ]


def test_eval_cli_continuation_and_passkey(run, capsys):
    # Past the 32 tokens the tiny model was trained on: allowed explicitly (the refusal is tested elsewhere).
    args = [
        "eval",
        run,
        "--corpus",
        SMALL_CORPUS,
        "--prefix",
        "48",
        "--continuation",
        "8",
        "--samples",
        "2",
        "--allow-long-context",
    ]
    assert main([*args, "--policy", "snapkv:0.5:obs_window=8", "--policy", "streaming:0.25"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in out.splitlines() if line.startswith("| ")}
    assert float(rows["full"][2]) == 0.0  # KL of the full cache against itself
    assert float(rows["snapkv:0.5:obs_window=8"][2]) > 0
    full_bytes = float(rows["full"][3].replace(",", ""))
    assert float(rows["streaming:0.25"][3].replace(",", "")) < full_bytes
    assert (
        main(
            [
                "eval",
                run,
                "--corpus",
                SMALL_CORPUS,
                "--task",
                "passkey",
                "--policy",
                "tova:0.5",
                "--lengths",
                "300",
                "--depths",
                "0.5",
                "--trials",
                "2",
                "--allow-long-context",
            ]
        )
        == 0
    )
    assert "tova:0.5" in capsys.readouterr().out
    new_methods = [
        "minicache:0.9",
        "d2o:0.5",
        "think:0.5:obs_window=8,window=4",
        "scissorhands:0.5:obs_window=8",
        "gear:2:group=8,residual=16,rank=1,outliers=0",
        "lorc:0.5",
        "palu:0.5",  # calibrated on the corpus; its bytes are planned from the ratio alone
    ]
    assert main([*args, *(x for m in new_methods for x in ("--policy", m))]) == 0
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    }
    full_bytes = float(rows["full"][3].replace(",", ""))
    for method in new_methods:  # every method runs from the command line and stores fewer bytes
        (name,) = [n for n in rows if n.startswith(method.split(":")[0] + ":")]
        if method.startswith("d2o"):  # D2O never compresses the first two and the last layer: all of these
            assert float(rows[name][2]) < 1e-3, name
            continue
        assert float(rows[name][3].replace(",", "")) < full_bytes, name
    assert main(["eval", run, "--policy", "snapkv:2.5"]) == 2
    assert "whole number" in capsys.readouterr().err
    assert main(["eval", run, "--task", "ppl", "--policy", "snapkv:0.5"]) == 2


@pytest.mark.slow
def test_compare_policy_table(run, tmp_path, capsys):
    # No lengths given: the defaults (1536-token prefix ...) are fitted to the run's 32-token context.
    assert (
        main(
            [
                "compare",
                "--policy",
                "snapkv:obs_window=8",
                "--policy",
                "kivi:2:group=8,residual=16",
                "--ratios",
                "0.5",
                "--model",
                run,
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1 x (23-token prefix + 8 scored), decode at 32 tokens" in out
    assert "snapkv:0.5:obs_window=8" in out and "kivi:2" in out
    (table,) = tmp_path.glob("policies-*.json")
    rows = json.loads(table.read_text())
    assert [r["ratio"] for r in rows] == [None, 0.5, None]
    assert rows[2]["policy"] == "kivi:2:group=8,residual=16"
    assert rows[1]["cache_bytes_per_token"] < rows[0]["cache_bytes_per_token"]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)


def test_duo_train_writes_the_runs_pattern_and_eval_reads_it(run, capsys):
    common = ["--corpus", SMALL_CORPUS, "--allow-long-context"]
    policy = ["--policy", "duo:0.5:sinks=4,window=8"]
    assert main(["eval", run, "--prefix", "48", "--continuation", "8", *policy, *common]) == 2
    assert "kvjax duo-train" in capsys.readouterr().err  # no pattern yet: refused before compute
    assert (
        main(
            [
                "duo-train",
                run,
                "--steps",
                "3",
                "--length",
                "400",
                "--keys",
                "1",
                "--words",
                "2",
                "--sinks",
                "4",
                "--recent",
                "16",
                *common,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    record = json.loads((Path(run) / "duo_pattern.json").read_text())
    assert len(record["gates"]) == 2 and record["training"]["steps"] == 3 and "held-out objective" in out
    learned = (Path(run) / "duo_pattern.json").read_bytes()
    assert main(["duo-train", run, "--steps", "1", *common]) == 2  # a learned pattern is kept unless --overwrite
    assert "duo_pattern.json exists" in capsys.readouterr().err
    assert (Path(run) / "duo_pattern.json").read_bytes() == learned
    assert main(["eval", run, "--prefix", "48", "--continuation", "8", *policy, *common]) == 0
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    }
    (duo,) = [name for name in rows if name.startswith("duo:0.5")]
    assert duo.endswith("duo_pattern.json")
    assert float(rows[duo][3].replace(",", "")) < float(rows["full"][3].replace(",", ""))

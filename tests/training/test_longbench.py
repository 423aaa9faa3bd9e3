"""LongBench: each official metric on hand-worked cases, THUDM's file formats read (and bad files named in
one line), prompts split where the context ends, and `kvjax longbench` sweeping, resuming and tabling v1
and v2 on a random model."""

import json
import re

import pytest

from kvjax.config import ConfigError
from kvjax.training import longbench as lb


def test_each_metric_on_hand_worked_cases():
    # QA F1 over normalized tokens: "paris france" against "paris" is P 1/2, R 1
    assert lb.qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert lb.qa_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert lb.qa_f1("yes", "no") == 0.0
    # ROUGE-L (the rouge package's summary level, over each text's distinct words): LCS cat sat on mat = 4,
    # 5 distinct words in the answer, 6 in the reference: P 4/5, R 4/6, F 8/11
    assert lb.rouge_l("the cat sat on the mat", "a cat sat on a mat today") == pytest.approx(8 / 11, abs=1e-6)
    assert lb.rouge_l("", "a reference") == 0.0
    # trec: a label that is only part of the reference is not counted, and LongBench's loop, removing while it
    # iterates, skips the label after each one it removes ("Person" survives here): 1/2, not 1
    classes = ("Per", "Person", "Personal title", "Date")
    assert lb.classification("Personal title", "Personal title", classes=classes[2:]) == 1.0
    assert lb.classification("Date or Personal title", "Personal title", classes=classes[2:]) == 0.5
    assert lb.classification("Per Person Personal title", "Personal title", classes=classes[:3]) == 0.5
    assert lb.classification("Date", "Personal title", classes=classes) == 0.0
    # retrieval and count: the share of the answer's numbers that are right
    assert lb.retrieval("Paragraph 12, or Paragraph 3", "Paragraph 3") == 0.5
    assert lb.count("7 unique paragraphs out of 10", 7) == 0.5 and lb.count("none", 7) == 0.0
    # code: the first line that is no fence or comment; difflib's 2M/T = 2 * 9 / 20, a whole percent
    assert lb.code_sim("```python\n# the call\nx = foo(1)\n", "x = foo(2)") == 0.9
    assert lb.code_sim("ab", "abc") == 0.8  # 2 * 2 / 5
    # v2: the letter pred.py extracts, bold or bracketed
    assert [lb.extract_choice(a) for a in ("The correct answer is (B).", "**The correct answer is C**", "B")] == [
        "B",
        "C",
        None,
    ]


def test_score_takes_the_best_reference_and_the_first_line_where_longbench_does():
    sample = lb.Sample("triviaqa", 0, "", "", ("Paris", "City of Light"))
    assert lb.score(sample, "Paris\nand more lines") == 1.0  # the second line is never read
    assert lb.score(lb.Sample("hotpotqa", 0, "", "", ("a b", "b c d")), "b c d e") == pytest.approx(6 / 7)
    assert lb.score(lb.Sample(lb.V2, 0, "", "", ("A",)), "The correct answer is (A)") == 1.0


def test_a_long_context_is_cut_in_its_middle_and_the_question_kept_whole():
    context = list(range(10))
    assert lb.truncate(context, [97, 98, 99], max_length=9) == [0, 1, 2, 7, 8, 9]  # 6 of 10: halves 3 and 3
    assert lb.truncate(context, [97, 98, 99], max_length=10) == [0, 1, 2, 6, 7, 8, 9]  # 7: the end gets the odd one
    assert lb.truncate(context, [99], max_length=11) == context
    with pytest.raises(ConfigError, match="max_length=4 leaves no room for a context before 3 question tokens"):
        lb.truncate(context, [97, 98, 99], max_length=4)


def _v1_file(path, task, n):
    rows = [
        {
            "input": f"Who wrote book {i}?",
            "context": f"Passage 1: book {i} was written by Ann.\nPassage 2: other text.",
            "answers": ["Ann"],
            "all_classes": None,
            "length": 12,
            "_id": str(i),
        }
        for i in range(n)
    ]
    (path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _v2_file(path, n):
    rows = [
        {
            "_id": str(i),
            "domain": "d",
            "sub_domain": "s",
            "difficulty": ("easy", "hard")[i % 2],
            "length": ("short", "long")[i % 2],
            "question": "Which letter is first?",
            "choice_A": "A",
            "choice_B": "B",
            "choice_C": "C",
            "choice_D": "D",
            "answer": "A",
            "context": "The alphabet starts with A. " * 4,
        }
        for i in range(n)
    ]
    (path / "data.json").write_text(json.dumps(rows))


def test_thudms_files_are_read_split_at_the_context_and_bad_ones_named(tmp_path):
    _v1_file(tmp_path, "hotpotqa", 3)
    _v2_file(tmp_path, 2)
    first = lb.load(tmp_path, "hotpotqa", 2)
    assert len(first) == 2 and first[1].answers == ("Ann",)
    assert first[0].context.endswith("Passage 2: other text.") and "Who wrote book 0?" not in first[0].context
    assert first[0].question.startswith("\n\nAnswer the question") and first[0].question.endswith("Answer:")
    v2 = lb.load(tmp_path, lb.V2)
    assert [(s.difficulty, s.size) for s in v2] == [("easy", "short"), ("hard", "long")]
    assert v2[0].context.endswith("starts with A.") and "(D) D" in v2[0].question
    with pytest.raises(ConfigError, match=r"no .*musique.jsonl \(unpack THUDM's LongBench data there"):
        lb.load(tmp_path, "musique")
    (tmp_path / "qasper.jsonl").write_text('{"input": "q"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"qasper.jsonl is not LongBench's JSON \(.* at line 2\)"):
        lb.load(tmp_path, "qasper")
    (tmp_path / "qasper.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(ConfigError, match="qasper.jsonl record 1 has no answers, all_classes"):
        lb.load(tmp_path, "qasper")


def test_the_command_sweeps_both_versions_resumes_and_writes_its_tables(make_model, tmp_path, capsys):
    """On a random model exported as a Hugging Face checkpoint: v1 (two tasks, a policy at one ratio) and
    v2 write their tables (v2 by difficulty and length); run again, nothing is computed; a missing data
    file stops the command in one line before the weights load."""
    from kvjax.commands import main
    from kvjax.training.hf_export import export_hf, export_tokenizer
    from kvjax.training.tokenizer import ByteTokenizer

    model = make_model("gqa", "model.n_layers=1")[1]
    hf = export_hf(model, tmp_path / "hf", bos_id=256, eos_id=257, max_positions=1024)
    export_tokenizer(ByteTokenizer(), hf)
    data = tmp_path / "data"
    data.mkdir()
    _v1_file(data, "hotpotqa", 2)
    _v1_file(data, "triviaqa", 2)
    _v2_file(data, 2)
    common = ["--samples", "2", "--max-length", "320", "--no-progress"]
    v1 = ["longbench", str(hf), "--data", str(data), "--tasks", "hotpotqa", "triviaqa", "--policy", "snapkv"]
    v1 += ["--ratios", "0.5", "--out", str(tmp_path / "v1"), *common]
    assert main(v1) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\b8 cells computed in [\d.]+ s, 0 read", printed)
    assert "question-agnostic, prompts of at most 320 tokens" in printed and "| snapkv:0.5 |" in printed
    assert main(v1) == 0 and re.search(r"\b0 cells computed in [\d.]+ s, 8 read", capsys.readouterr().out)
    records = [json.loads(line) for line in (tmp_path / "v1" / "results.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"hotpotqa", "triviaqa"} and all(0 <= r["score"] <= 1 for r in records)
    assert all(r["answers"] == ["Ann"] and r["query_aware"] is False for r in records)
    v2 = ["longbench", str(hf), "--data", str(data), "--version", "2", "--out", str(tmp_path / "v2"), *common]
    assert main(v2) == 0
    table = (tmp_path / "v2" / "results-v2.md").read_text()
    assert re.search(r"policy \| overall \| +easy \| +hard \| +short \| medium \| +long \|", table)
    assert re.search(r"\| full +\| [\d.]+ \(2\) \| [\d.]+ \(1\) \|", table)
    assert main(["longbench", "nowhere", "--data", str(tmp_path / "none"), "--tasks", "qmsum"]) == 2
    assert "no " in capsys.readouterr().err and not (tmp_path / "none").exists()

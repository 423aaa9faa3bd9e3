"""Every script in scripts/ runs at its smallest setting (one was once broken by a removed helper): the
benchmarks end to end in a fresh process, the 50-minute training script by parsing each of its commands."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.commands import build_parser, main
from kvjax.commands.args import split_overrides
from kvjax.config import load_config
from kvjax.training.hf_export import export_hf
from kvjax.training.loading import load_decoder
from tests.training.conftest import SMALL_CORPUS
from tests.training.test_cli import TINY

ROOT = Path(__file__).resolve().parent.parent
SMALLEST = {
    "accelerator_check.py": ["--tiny", "--out", "OUT"],
    "bench_decode.py": ["--batch", "1", "--context", "64", "--steps", "2", "--repeats", "1"],
    "bench_mla.py": ["--batch", "1", "--lengths", "64", "--steps", "2", "--repeats", "1"],
    "bench_yoco.py": ["--lengths", "64", "--chunk", "32", "--repeats", "1"],
    "bench_recurrent.py": [
        "--batch",
        "1",
        "--seq-len",
        "16",
        "--decode-batch",
        "1",
        "--contexts",
        "32",
        "64",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--variants",
        "mamba",
    ],
    "bench_pool_switch.py": ["--no-runs", "--random", "2", "--max-pool-mb", "0.5", "--repeats", "1", "--fit"],
    "bench_kernels.py": [
        "--contexts",
        "64",
        "--batch",
        "1",
        "--repeats",
        "1",
        "--dtype",
        "float32",
        "--quant",
        "int:8",
    ],
    "bench_serving.py": ["gqa", "--requests", "2", "--prompt", "8", "16", "--new", "2", "4", "--memory-mib", "1"],
    "bench_compression.py": [
        "--model",
        "RUN",
        "--context",
        "64",
        "--ratios",
        "0.5",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--policy",
        "int:8",
    ],
    "bench_decode_curve.py": [
        "--experiment",
        "compare",
        "--contexts",
        "64",
        "--repeats",
        "1",
        "--variants",
        "gqa",
        "--out",
        "OUT",
    ],
    "bench_train.py": ["--batch", "1", "--seq-len", "16", "--steps", "2", "--corpus", SMALL_CORPUS],
    "bench_vs_transformers.py": [
        "--model",
        "HF",
        "--context",
        "32",
        "--batches",
        "1",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
    ],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scripts") / "gqa")
    assert main(["train", "gqa", *TINY, "--run-dir", path]) == 0
    return path


def test_every_script_has_a_smallest_setting():
    scripts = {p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == {*SMALLEST, "train_retrieval.sh"}


# Every benchmark in one fresh process, one after the other (`runpy`, each with its own argv, working
# directory and captured output): a broken import or a crash still fails that script's test, and the
# suite pays for starting Python, jax and kvjax once instead of once per script.
RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for script, args, cwd in json.loads(sys.argv[1]):
    os.makedirs(cwd, exist_ok=True)
    os.chdir(cwd)
    sys.argv = [script, *args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    results[os.path.basename(script)] = {"rc": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def benchmarks(run, tmp_path_factory):
    """Each benchmark's exit code and output at its smallest setting."""
    out = tmp_path_factory.mktemp("benchmarks")
    hf = export_hf(load_decoder(run)[1], out / "hf")  # the run as a Hugging Face directory
    jobs = []
    for script, args in sorted(SMALLEST.items()):
        cwd = out / script.removesuffix(".py")
        args = [a.replace("RUN", run).replace("OUT", str(cwd / "out")).replace("HF", str(hf)) for a in args]
        jobs.append((str(ROOT / "scripts" / script), args, str(cwd)))
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_a_benchmark_runs_at_its_smallest_setting(script, benchmarks):
    result = benchmarks[script]
    assert result["rc"] == 0, result["stderr"]
    assert "|" in result["stdout"] or "{" in result["stdout"]  # a table or a JSON record of figures


@pytest.mark.slow
def test_the_accelerator_check_completes_every_section_at_toy_shapes(benchmarks, tmp_path_factory):
    """scripts/accelerator_check.py --tiny: every section ran without an error and wrote its figures."""
    assert benchmarks["accelerator_check.py"]["rc"] == 0, benchmarks["accelerator_check.py"]["stdout"][-3000:]
    out = next(Path(tmp_path_factory.getbasetemp()).glob("benchmarks*/accelerator_check/out"))
    results = json.loads((out / "results.json").read_text())
    sections = ("device", "parity", "memory", "prefill", "decode", "compressed", "engine", "train")
    assert all(results[name] and "error" not in results[name][0] for name in sections)
    assert results["parity"][0]["max_abs_logit_diff"] < 0.05 * max(1.0, results["parity"][0]["logit_scale"])
    assert (out / "results.md").read_text().startswith("# kvjax on ")


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3.1-8b"])
def test_the_shipped_llama_shapes_are_the_accelerator_checks(shape, monkeypatch):
    """configs/models/llama-*.yaml (what `kvjax memory` plans) equal the config.json fields the accelerator
    check gives transformers, read by kvjax's Llama mapping."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import accelerator_check

    assert load_config(shape).model == accelerator_check.kvjax_config(shape)


def test_the_training_script_commands_parse(tmp_path):
    """train_retrieval.sh trains for 50 minutes: its commands are recorded by a stand-in for `kvjax`, then
    parsed here and their configs validated (train.init names runs the script would have made)."""
    calls = tmp_path / "calls"
    shim = tmp_path / "kvjax"
    shim.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> {calls}\nprintf "\\n" >> {calls}\n')
    shim.chmod(0o755)
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "train_retrieval.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVJAX": str(shim)},
    )
    assert result.returncode == 0, result.stderr
    commands = [line.rstrip("\0").split("\0") for line in calls.read_text().splitlines()]
    assert [c[0] for c in commands] == ["train"] * 4 + ["eval"] * 2
    for argv in commands:
        args = build_parser().parse_args(argv)
        if args.command == "train":
            names, overrides = split_overrides(args.config)
            load_config(names[0], [o for o in overrides if not o.startswith("train.init=")])

"""Training over a data x fsdp x tensor mesh and as several real processes on 127.0.0.1 (JAX's coordinator,
gloo collectives): 8 devices give what 1 gives, 2 processes x 4 devices what 1 process x 8 gives; an
interrupted 2-process run resumes in 2 and in 1 process, and `kvjax compare` restores a 1-process run in
2; each process feeds its own rows; careless launches fail with one line, in bounded time."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from kvjax.commands.launch import environments, free_port
from kvjax.config import load_config
from kvjax.sharding import param_spec
from kvjax.training.data import BatchIterator, TrainingMix
from kvjax.training.distributed import ADDRESS, COUNT, INDEX, TIMEOUT, DistributedError, initialize
from kvjax.training.trainer import Trainer, load_trained
from kvjax.training.vocab import get_tokenizer
from tests.training.conftest import SMALL_RUN

STEPS = 20
ARGS = [
    "gqa",
    *SMALL_RUN,
    "train.batch_size=8",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.checkpoint_every=10",
    f"train.eval_every={STEPS}",
    "train.log_every=1",
    "mesh.data=2",  # across the processes; fsdp and tensor within each
    "mesh.fsdp=2",
    "mesh.tensor=2",
]
LIMIT = 300  # seconds any run may take: a hang fails the test instead of stalling the suite


def _start(run_dir, processes: int, *extra: str, timeout: int = 60) -> list[subprocess.Popen]:
    """The run's processes (`kvjax train` each; one process gets 8 devices, as many as two of 4)."""
    command = [sys.executable, "-m", "kvjax.commands", "train", *ARGS, *extra, "--run-dir", str(run_dir)]
    envs = [dict(env, **{TIMEOUT: str(timeout)}) for env in environments(processes, free_port(), 8 // processes)]
    out = subprocess.DEVNULL
    return [subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.PIPE, text=True) for env in envs]


def _finish(procs) -> list[tuple[int, str]]:
    """(status, stderr) of each process, once all have ended."""
    errs = [p.communicate(timeout=LIMIT)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def _train(run_dir, processes: int, *extra: str) -> list[dict]:
    for code, err in _finish(_start(run_dir, processes, *extra)):
        assert code == 0, err[-3000:]
    return _metrics(run_dir)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _params(run_dir) -> list[np.ndarray]:
    _, model, _ = load_trained(run_dir)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 20 steps on one device (in this process), as 1 process x 8 devices, and as 2 processes x 4
    interrupted by a SIGINT to process 0 alone, then resumed as 2 x 4 (a copy taken at the interruption
    stays for a resume in 1 process). Run one after the other: each takes both cores."""
    root = tmp_path_factory.mktemp("distributed")
    alone = Trainer(load_config(ARGS[0], [*ARGS[1:], "mesh.fsdp=1", "mesh.tensor=1", "mesh.data=1"]), root / "alone")
    history = alone.run()
    one = _train(root / "one", 1)
    two = root / "two"
    procs = _start(two, 2)
    _wait_for_step(two, 3, procs)
    procs[0].send_signal(signal.SIGINT)
    stop = _finish(procs)
    shutil.copytree(two, root / "stopped")
    two_steps = _train(two, 2)
    return {
        "alone": (alone, history),
        "one": (root / "one", one),
        "stop": stop,
        "stopped": root / "stopped",
        "two": (two, two_steps),
    }


@pytest.mark.slow
def test_eight_devices_train_what_one_device_trains(runs):
    """Data x fsdp x tensor = 2 x 2 x 2 on 8 devices of one process == one device: losses within 1e-5,
    with the heads and MLP hidden split over tensor and each weight's largest other dimension over fsdp."""
    (alone, history), (_, one) = runs["alone"], runs["one"]
    np.testing.assert_allclose([r["loss"] for r in one], [r["loss"] for r in history], atol=1e-5, rtol=0)
    mesh = SimpleNamespace(shape={"data": 2, "fsdp": 2, "tensor": 2})  # param_spec reads the axis sizes only
    specs = {
        jax.tree_util.keystr(path): param_spec(path, x.shape, mesh)
        for path, x in jax.tree_util.tree_leaves_with_path(alone.state.params)
    }
    q = next(s for p, s in specs.items() if "blocks" in p and "'q'" in p and "kernel" in p)
    down = next(s for p, s in specs.items() if "'down'" in p and "kernel" in p)
    assert q == P("fsdp", "tensor") and down == P("tensor", "fsdp")


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(runs):
    """Interrupted and resumed, 2 x 4 gives the losses, final parameters and scores of 1 x 8 (within 1e-5)."""
    (one_dir, one), (two_dir, two) = runs["one"], runs["two"]
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # each step once, across the interruption
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], atol=1e-5, rtol=0)
    assert abs(two[-1]["eval_loss"] - one[-1]["eval_loss"]) <= 1e-5
    for a, b in zip(_params(two_dir), _params(one_dir), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert {"10", "20"} <= {p.name for p in (two_dir / "checkpoints").iterdir()}


@pytest.mark.slow
def test_an_interrupted_run_stops_every_process_and_resumes_in_one(runs):
    """SIGINT to process 0 alone: both processes stop at the same step, checkpoint it and say so; the
    checkpoint resumed as 1 x 8 continues the 1 x 8 loss curve (within 1e-5)."""
    assert [code for code, _ in runs["stop"]] == [130, 130], runs["stop"]
    stopped = _metrics(runs["stopped"])[-1]["step"]
    assert 3 <= stopped < STEPS
    assert str(stopped) in [p.name for p in (runs["stopped"] / "checkpoints").iterdir()]
    for _, err in runs["stop"]:
        assert f"stopped at step {stopped} of {STEPS} (Ctrl-C)" in err
    resumed = _train(runs["stopped"], 1)
    _, one = runs["one"]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in one], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_processes_evaluate_what_training_evaluated(runs):
    """`kvjax eval`'s perplexity as 2 processes (4 of the 8 validation windows each, sums added) is the
    score training logged at its last step; only process 0 prints."""
    run_dir, history = runs["one"]
    command = [sys.executable, "-m", "kvjax.commands", "eval", str(run_dir), "--windows", "8", "--batch", "8"]
    envs = [dict(env, **{TIMEOUT: "60"}) for env in environments(2, free_port(), 1)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(command, env=env, **pipes) for env in envs]
    outs = [p.communicate(timeout=LIMIT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    loss = float(re.search(r"\(loss (\d+\.\d+) nats/token\)", outs[0][0]).group(1))
    assert abs(loss - history[-1]["eval_loss"]) <= 1e-4  # printed to 4 decimals
    assert _printed(outs[1][0]) == ""


@pytest.mark.slow
def test_two_processes_compare_what_one_process_trained(runs, tmp_path):
    """`kvjax compare` as 2 x 4 over a variant 1 x 8 trained (restored across process counts, the other
    way from the resume above): the score training logged, bytes measured == analytic (checked inside),
    decode timed on each process's whole copy; only process 0 prints and writes."""
    run_dir, history = runs["one"]
    shutil.copytree(run_dir, tmp_path / "gqa")
    experiment = {"variants": ["gqa"], "overrides": ARGS[1:], "decode_batch": 2, "decode_context": 32}
    experiment["decode_tokens"] = 8
    (tmp_path / "tiny.yaml").write_text(json.dumps(experiment))  # JSON is YAML
    command = [sys.executable, "-m", "kvjax.commands", "compare", "--quick", "--experiment", "tiny.yaml", "--out", "."]
    envs = [dict(env, **{TIMEOUT: "60"}) for env in environments(2, free_port(), 4)]
    pipes = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(command, env=env, **pipes) for env in envs]
    outs = [p.communicate(timeout=LIMIT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"reusing the finished run in gqa ({STEPS} steps)" in outs[0][0]
    (row,) = json.loads((tmp_path / "tiny.json").read_text())["rows"]
    assert abs(row["val_bpb"] - history[-1]["eval_bpb"]) <= 1e-5 and row["decode_tokens_per_s"] > 0
    assert {"tiny.csv", "tiny.png"} <= {p.name for p in tmp_path.iterdir()}
    assert _printed(outs[1][0]) == ""


def _printed(out: str) -> str:
    """What a process printed besides gloo's connection reports. Its threads write each report in pieces
    at once, so pieces of several reports interleave anywhere between them: drop the pieces, then the
    rank numbers they leave (process 1 prints nothing else, so a leftover word fails the check)."""
    pieces = r"\[Gloo\] Rank |Expected number of connected peer ranks is :|is connected to|peer ranks\.?"
    rest = re.sub(pieces, " ", out)
    return "" if re.fullmatch(r"[\d\s]*", rest) else rest.strip()


def _wait_for_step(run_dir, step: int, procs) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + LIMIT
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _finish(procs)
        time.sleep(0.05)


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_reads_its_own_rows_of_every_batch(processes):
    """The processes' parts of each batch, text and pass-key rows mixed in, are the one-process batch in
    order: no row twice, none missing, across an epoch boundary."""
    windows = np.arange(20 * 301, dtype=np.int32).reshape(20, 301) % 250
    mix = TrainingMix(get_tokenizer("byte"), passkey=0.5)
    whole = BatchIterator(windows, 8, seed=3, mix=mix)
    rows = 8 // processes
    parts = [BatchIterator(windows, 8, 3, mix=mix, part=slice(i * rows, (i + 1) * rows)) for i in range(processes)]
    for _ in range(5):  # 2 batches per epoch
        batch, weights = next(whole)
        got = [next(p) for p in parts]
        np.testing.assert_array_equal(np.concatenate([b for b, _ in got]), batch)
        np.testing.assert_array_equal(np.concatenate([w for _, w in got]), weights)
        assert all(len(b) == rows for b, _ in got)


def test_careless_launches_fail_with_one_line(tmp_path, monkeypatch):
    """Processes given different configs or run directories, or a batch their devices cannot share
    evenly, refuse together; a process whose coordinator never comes up gives up after
    KVJAX_DISTRIBUTED_TIMEOUT seconds, naming it."""
    command = [sys.executable, "-m", "kvjax.commands", "train", *ARGS]
    launches = {  # the last line each process prints: each pair's arguments
        "the config differs between processes": ["train.lr=1e-3", "train.lr=2e-3"],
        "the run directory differs between processes": ["--run-dir=a", "--run-dir=b"],
        "train.batch_size=6 must be a multiple of mesh data x fsdp = 4 (2 processes)": ["train.batch_size=6"] * 2,
    }
    procs = {}  # every pair at once
    for error, args in launches.items():
        envs = [dict(env, **{TIMEOUT: "60"}) for env in environments(2, free_port(), 4)]
        pipes = dict(cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs[error] = [subprocess.Popen([*command, arg], env=env, **pipes) for arg, env in zip(args, envs)]
    for error, pair in procs.items():
        for code, err in _finish(pair):
            assert code == 2, err
            assert err.strip().splitlines()[-1].startswith(f"kvjax: error: {error}"), err
    address = environments(2, free_port(), 1)[1][ADDRESS]  # nobody listens there
    for name, value in {ADDRESS: address, COUNT: "2", INDEX: "1", TIMEOUT: "1"}.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(DistributedError) as lost:  # raised before JAX is asked to join, so this process is unchanged
        initialize()
    assert time.monotonic() - start < 10
    assert str(lost.value) == (
        f"no coordinator answered at JAX_COORDINATOR_ADDRESS={address} within 1 s (KVJAX_DISTRIBUTED_TIMEOUT); "
        "is process 0 running, and is the address reachable from this host?"
    )

"""Training as several real processes on 127.0.0.1 (JAX's coordinator, gloo collectives): 2 processes x 4
CPU devices give what 1 process x 8 gives; an interrupted 2-process run resumes in 2 and in 1 process;
each process feeds its own rows; careless launches fail with one line, in bounded time."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvjax.commands.launch import environments, free_port
from kvjax.training.data import BatchIterator, TrainingMix
from kvjax.training.distributed import TIMEOUT
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
]
LIMIT = 300  # seconds any run may take: a hang fails the test instead of stalling the suite


def _start(run_dir, processes: int, *extra: str, timeout: int = 20) -> list[subprocess.Popen]:
    """The run's processes (`kvjax train` each; one process gets 8 devices, as many as two of 4)."""
    command = [sys.executable, "-m", "kvjax.commands", "train", *ARGS, *extra, "--run-dir", str(run_dir)]
    envs = environments(processes, free_port(), 8 // processes)
    if processes == 1:  # a plain process: no coordinator
        envs = [{k: v for k, v in envs[0].items() if not k.startswith("JAX_")}]
    envs = [dict(env, **{TIMEOUT: str(timeout)}) for env in envs]
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
    import jax

    from kvjax.training.trainer import load_trained

    _, model, _ = load_trained(run_dir)
    from flax import nnx

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 20 steps as 1 process x 8 devices and as 2 processes x 4 (run one after the other: each
    takes both cores)."""
    root = tmp_path_factory.mktemp("distributed")
    return {n: (root / f"p{n}", _train(root / f"p{n}", n)) for n in (1, 2)}


def test_two_processes_train_what_one_process_trains(runs):
    (one_dir, one), (two_dir, two) = runs[1], runs[2]
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], atol=1e-5, rtol=0)
    assert abs(two[-1]["eval_loss"] - one[-1]["eval_loss"]) <= 1e-5
    for a, b in zip(_params(two_dir), _params(one_dir), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert sorted(p.name for p in (two_dir / "checkpoints").iterdir()) == ["10", "20"]


def test_an_interrupted_run_resumes_in_two_processes_and_in_one(runs, tmp_path):
    """SIGINT to process 0 alone: both processes stop at the same step and checkpoint it. Resumed as 2 x 4
    the loss curve is the uninterrupted 2-process one, bitwise; resumed as 1 x 8, within 1e-5."""
    run_dir = tmp_path / "run"
    procs = _start(run_dir, 2)
    _wait_for_step(run_dir, 3, procs)
    procs[0].send_signal(signal.SIGINT)
    results = _finish(procs)
    assert [code for code, _ in results] == [130, 130], results
    stopped = _metrics(run_dir)[-1]["step"]
    assert 3 <= stopped < STEPS
    assert str(stopped) in [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert f"stopped at step {stopped} of {STEPS} (Ctrl-C)" in results[0][1]
    one_dir = tmp_path / "one"
    shutil.copytree(run_dir, one_dir)
    two = _train(run_dir, 2)
    one = _train(one_dir, 1)
    (_, uninterrupted), (_, single) = runs[2], runs[1]
    assert [r["loss"] for r in two] == [r["loss"] for r in uninterrupted]  # bitwise: the same mesh
    np.testing.assert_allclose([r["loss"] for r in one], [r["loss"] for r in single], atol=1e-5, rtol=0)


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


def test_careless_launches_fail_with_one_line(tmp_path):
    """Processes given different configs refuse together; a process whose coordinator never comes up gives
    up after KVJAX_DISTRIBUTED_TIMEOUT seconds, naming it; when process 0 is killed mid-run, the other ends."""
    command = [sys.executable, "-m", "kvjax.commands", "train", *ARGS]
    mismatches = [(["train.lr=1e-3", "train.lr=2e-3"], "config"), (["--run-dir=a", "--run-dir=b"], "run directory")]
    for differ, what in mismatches:
        envs = [dict(env, **{TIMEOUT: "20"}) for env in environments(2, free_port(), 4)]
        procs = [
            subprocess.Popen(
                [*command, arg], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            for arg, env in zip(differ, envs)
        ]
        for code, err in _finish(procs):
            assert code == 2, err
            assert err.strip().splitlines()[-1].startswith(f"kvjax: error: the {what} differs between processes"), err
    env = dict(environments(2, free_port(), 1)[1], **{TIMEOUT: "2"})
    start = time.monotonic()
    lost = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert lost.returncode == 2 and time.monotonic() - start < 30
    assert lost.stderr.strip().splitlines() == [
        f"kvjax: error: no coordinator answered at JAX_COORDINATOR_ADDRESS={env['JAX_COORDINATOR_ADDRESS']} within 2 s "
        "(KVJAX_DISTRIBUTED_TIMEOUT); is process 0 running, and is the address reachable from this host?"
    ]
    procs = _start(tmp_path / "killed", 2, timeout=3)
    _wait_for_step(tmp_path / "killed", 2, procs)
    start = time.monotonic()
    procs[0].kill()
    (_, _), (code, err) = _finish(procs)  # JAX ends the survivor (a fatal log, not a line of ours)
    assert code != 0 and time.monotonic() - start < 30, err[-2000:]

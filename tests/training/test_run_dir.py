"""A run directory is the unit a user resumes: its config.yaml, metrics that hold each step once,
Ctrl-C that stops cleanly, and `kvjax train RUN_DIR` resuming or extending it as written."""

import json
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from kvjax.commands import main
from kvjax.training.checkpoint import Checkpointer
from kvjax.training.trainer import STOPPING, Trainer, TrainingInterrupted
from tests.training.test_cli import TINY


def test_a_run_directory_resumes_as_written_and_extends_explicitly(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "gqa", *TINY, "--run-dir", str(run)]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["steps"] == 6 and saved["data"]["seq_len"] == 32
    capsys.readouterr()
    assert main(["train", str(run)]) == 0  # no overrides retyped
    assert "from step 6 of 6 (finished: nothing to train)" in capsys.readouterr().out
    assert main(["train", str(run), "train.steps=8"]) == 0
    out = capsys.readouterr().out
    assert "train.steps 6 -> 8: the learning-rate schedule now decays over 8 steps" in out
    assert json.loads(out.strip().splitlines()[-1])["step"] == 8
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 8
    assert main(["train", str(run), "train.lr=1e-2"]) == 2  # any other change is refused, as before
    assert "train.lr: checkpoint" in capsys.readouterr().err
    assert main(["train", str(run), "--run-dir", str(tmp_path / "elsewhere")]) == 2
    (run / "config.yaml").unlink()  # a run made before config.yaml was written: its checkpoint's record
    assert main(["train", str(run), "train.steps=9"]) == 0
    assert "train.steps 8 -> 9" in capsys.readouterr().out


def test_metrics_of_steps_lost_to_a_crash_are_replaced_not_repeated(small_config, tmp_path):
    cfg = small_config("train.steps=6", "train.checkpoint_every=3", "train.log_every=1")
    first = Trainer(cfg, tmp_path, progress=False)
    losses = [row["loss"] for row in first.run()]
    # A crash after step 6 was logged but before it was checkpointed: only step 3 is on disk.
    first.checkpoints.manager.delete(6)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # and a row cut short as the process died
    again = Trainer(cfg, tmp_path, progress=False)
    assert again.step == 3
    resumed = [row["loss"] for row in again.run()]
    np.testing.assert_array_equal(resumed, losses[3:])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == losses


def test_ctrl_c_checkpoints_the_step_and_says_how_to_resume(tmp_path):
    run = tmp_path / "run"
    long = [
        *TINY,
        "train.steps=100000",
        "train.eval_every=100000",
        "train.checkpoint_every=100000",
        "train.log_every=1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvjax.commands", "train", "gqa", *long, "--run-dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    step = Checkpointer(run / "checkpoints").latest_step()
    assert STOPPING in err  # the first Ctrl-C is acknowledged at once
    assert f"stopped at step {step} of 100000 (Ctrl-C); last checkpoint: step {step}" in err
    assert f"resume with: {shlex.join(['kvjax', 'train', 'gqa', *long, '--run-dir', str(run)])}" in err  # as typed
    assert main(["train", str(run), f"train.steps={step + 2}"]) == 0
    assert Checkpointer(run / "checkpoints").latest_step() == step + 2


def test_a_second_ctrl_c_aborts_and_says_what_was_lost_and_where_the_last_checkpoint_is(small_config, tmp_path):
    cfg = small_config("train.steps=20", "train.checkpoint_every=4", "train.eval_every=1000", "train.log_every=1")
    trainer = Trainer(cfg, tmp_path, progress=False)

    def before(signum, frame):  # the caller's own handler, which training must put back
        raise AssertionError("training's handler should have taken the Ctrl-C")

    previous = signal.signal(signal.SIGINT, before)

    def ctrl_c_twice(row):
        if row["step"] == 6:
            signal.raise_signal(signal.SIGINT)  # acknowledged; training would stop after this step...
            signal.raise_signal(signal.SIGINT)  # ...but a second one aborts at once

    with pytest.raises(
        TrainingInterrupted,
        match=rf"aborted at step 6 of 20 without saving \(Ctrl-C twice\): steps "
        rf"5-6 lost; last checkpoint: step 4 in {tmp_path}",
    ):
        trainer.run(log=ctrl_c_twice)
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 4
    restored = signal.signal(signal.SIGINT, previous)
    assert restored is before  # the handler is restored


def test_the_final_scores_are_those_logged_at_the_last_step_not_a_second_evaluation(small_config, tmp_path):
    trainer = Trainer(small_config("train.steps=4", "train.eval_every=4"), tmp_path, progress=False)
    history = trainer.run()
    logged = {k: v for k, v in history[-1].items() if k.startswith("eval_")}

    def evaluate_again(*args, **kwargs):
        raise AssertionError("`kvjax train` evaluated the last step twice")

    trainer.evaluate = evaluate_again
    assert trainer.final_scores(history) == logged and set(logged) == {"eval_loss", "eval_bpb", "eval_ppl"}
    resumed = Trainer(small_config("train.steps=4", "train.eval_every=4"), tmp_path, progress=False)
    assert resumed.final_scores(resumed.run()) == logged  # a finished run trains nothing, evaluates once

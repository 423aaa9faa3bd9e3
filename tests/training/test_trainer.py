import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from kvjax.config import ConfigError
from kvjax.training.checkpoint import CheckpointError
from kvjax.training.trainer import Trainer, TrainingError, load_trained


def losses(history):
    return [row["loss"] for row in history]


def test_resume_continues_bitwise(small_config, tmp_path):
    cfg = small_config()
    straight = losses(Trainer(cfg, tmp_path / "a", progress=False).run())
    half = losses(Trainer(cfg, tmp_path / "b", progress=False).run(stop_at=3))  # an interruption
    resumed = Trainer(cfg, tmp_path / "b", progress=False)
    assert resumed.step == 3
    rest = losses(resumed.run())
    assert len(straight) == 8 and half + rest == straight  # exact float equality
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8] and "eval_bpb" in rows[-1]
    assert Trainer(cfg, tmp_path / "b", progress=False).run() == []  # finished: nothing more to do


def test_gradient_accumulation_matches_one_big_batch(small_config, tmp_path):
    one = losses(Trainer(small_config("train.steps=3"), tmp_path / "a", progress=False).run())
    acc = losses(Trainer(small_config("train.steps=3", "train.grad_accum=2"), tmp_path / "b", progress=False).run())
    np.testing.assert_allclose(acc, one, rtol=1e-5)


def test_divergence_stops_and_keeps_the_last_good_checkpoint(small_config, tmp_path):
    cfg = small_config("train.lr=1e12", "train.grad_clip=1e30", "train.checkpoint_every=1", "train.steps=50")
    trainer = Trainer(cfg, tmp_path, progress=False)
    with pytest.raises(TrainingError, match="loss became (nan|inf) at step (\\d+); training stopped") as info:
        trainer.run()
    bad_step = int(info.value.args[0].split("at step ")[1].split(";")[0])
    kept = trainer.checkpoints.latest_step()
    assert kept == bad_step - 1 and f"Last good checkpoint: step {kept}" in str(info.value)


def test_mismatched_and_corrupt_checkpoints_are_clear_errors(small_config, tmp_path):
    Trainer(small_config("train.steps=4"), tmp_path, progress=False).run()
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="model.attention.n_kv_heads: checkpoint 2 vs now 1"):
        Trainer(small_config("model.attention.n_kv_heads=1"), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="train.lr: checkpoint 0.003 vs now 0.001"):
        Trainer(small_config("train.steps=4", "train.lr=1e-3"), tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing overwritten
    for path in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="checkpoint .*/4 cannot be read .* partial or corrupt"):
        Trainer(small_config("train.steps=4"), tmp_path, progress=False)
    shutil.rmtree(tmp_path / "checkpoints" / "4" / "record")
    with pytest.raises(CheckpointError, match="no readable record"):
        Trainer(small_config("train.steps=4"), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_trained(tmp_path / "elsewhere")


def test_load_trained_returns_the_trained_weights(small_config, tmp_path):
    trainer = Trainer(small_config("train.steps=4"), tmp_path, progress=False)
    trainer.run()
    config, model, tokenizer = load_trained(tmp_path)
    assert config == trainer.config and tokenizer.vocab_size == 258
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)


def test_train_init_starts_from_another_runs_weights(small_config, tmp_path):
    """train.init (a curriculum's next stage): the new run starts from the source run's trained weights,
    with other data settings, a fresh optimizer and step 0; once it has a checkpoint, resuming reads that
    instead. A missing directory or a model of another shape is a clear error before any training."""
    source = Trainer(small_config("train.steps=4"), tmp_path / "stage1", progress=False)
    source.run()
    cfg = small_config("train.steps=4", "data.seq_len=16", f"train.init={tmp_path / 'stage1'}")
    stage2 = Trainer(cfg, tmp_path / "stage2", progress=False)
    assert stage2.step == 0
    for a, b in zip(jax.tree.leaves(stage2.state.params), jax.tree.leaves(source.state.params)):
        np.testing.assert_array_equal(a, b)
    history = stage2.run(stop_at=2)
    assert history[0]["loss"] < 5.0  # a random init starts at ln(264) = 5.58 nats
    resumed = Trainer(cfg, tmp_path / "stage2", progress=False)
    assert resumed.step == 2
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(stage2.state.params)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match=r"train.init='.*/nowhere' is not a directory"):
        Trainer(small_config(f"train.init={tmp_path / 'nowhere'}"), tmp_path / "c", progress=False)
    with pytest.raises(ConfigError, match=r"differs from this run's in model.d_model, model.ffn_dim"):
        Trainer(
            small_config("model.d_model=64", "model.ffn_dim=96", f"train.init={tmp_path / 'stage1'}"),
            tmp_path / "d",
            progress=False,
        )
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()  # nothing written


def test_vocabulary_too_small_for_the_tokenizer(small_config, tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size=100 must be >= 258"):
        Trainer(small_config("model.vocab_size=100"), tmp_path, progress=False)


@pytest.mark.slow
def test_thirty_steps_on_the_bible_lower_validation_loss(tmp_path):
    """30 steps take the validation loss from 5.56 to 2.86 nats (4.13 bits per byte)."""
    from kvjax.config import load_config

    cfg = load_config(
        "gqa",
        ["train.steps=30", "train.warmup_steps=5", "train.eval_every=30", "data.seq_len=128", "data.eval_windows=16"],
    )
    trainer = Trainer(cfg, tmp_path, progress=False)
    before = trainer.evaluate()
    after = trainer.run()[-1]
    assert after["eval_loss"] < before["eval_loss"] - 1.0
    assert after["eval_bpb"] < 4.5


def test_weighted_steps_unit_weights_are_the_plain_step_and_accumulation_keeps_the_weights(small_config, tmp_path):
    """data.passkey_weight's objective: weights of 1 give the plain step (to float rounding: whether XLA
    folds the multiplications by 1 depends on its emitters); heavier tokens change the update; with
    grad_accum the weights follow their rows (== one big weighted batch)."""
    from functools import partial

    from kvjax.training.trainer import _train_step

    cfg = small_config("train.batch_size=4")
    trainer = Trainer(cfg, tmp_path / "a", progress=False)
    windows = trainer.corpus.train[:4]
    weights = np.ones((4, windows.shape[1] - 1), np.float32)
    heavy = weights.copy()
    heavy[1, 5:9] = heavy[3, 20:25] = 30.0

    def step(accum, w):
        train = dataclasses.replace(cfg.train, grad_accum=accum)
        new, metrics = jax.jit(partial(_train_step, trainer.graphdef, train, None))(
            trainer.state, windows, w, cfg.train.lr
        )
        return jax.tree.leaves(new.params), float(metrics["loss"]), float(metrics["grad_norm"])

    plain, loss, norm = step(1, None)
    unit, unit_loss, unit_norm = step(1, weights)
    weighted, weighted_loss, weighted_norm = step(1, heavy)
    accumulated, _, accumulated_norm = step(2, heavy)
    assert loss == unit_loss == weighted_loss  # the logged loss is the plain mean NLL
    np.testing.assert_allclose(unit_norm, norm, rtol=1e-6)
    assert abs(weighted_norm - norm) > 0.05 * norm  # (Adam's first update is ~lr * sign, so compare gradients)
    np.testing.assert_allclose(accumulated_norm, weighted_norm, rtol=1e-5)
    for a, b, c, d in zip(plain, unit, weighted, accumulated):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-7)


def test_fp32_master_weights_keep_the_updates_bf16_weights_lose(small_config, tmp_path):
    """`train.master_dtype=float32` on a bf16 model: the optimizer's weights and moments are fp32, the model
    computes with them cast to bf16 (the first loss is the bf16 model's), updates far below bf16's
    resolution accumulate (a bf16 model's own weights barely move), a run resumes exactly, and
    `load_trained` and `Trainer.model` give the bf16 model of the master weights."""
    small = ("model.dtype=bfloat16", "train.lr=1e-5", "train.warmup_steps=0", "train.steps=4")
    mixed_config = small_config(*small, "train.master_dtype=float32")
    plain = Trainer(small_config(*small), tmp_path / "bf16", progress=False)
    mixed = Trainer(mixed_config, tmp_path / "fp32", progress=False)
    start = [np.asarray(x, np.float32) for x in jax.tree.leaves(plain.state.params)]
    assert {x.dtype.name for x in jax.tree.leaves(mixed.state.params)} == {"float32"}
    assert {x.dtype.name for x in jax.tree.leaves(mixed.state.opt_state) if x.ndim > 0} == {"float32"}
    first = plain.run()[0]["loss"], mixed.run(stop_at=1)[0]["loss"]
    assert first[0] == first[1]  # the same bf16 forward: the master weights cast to bf16 are the model's
    resumed = Trainer(mixed_config, tmp_path / "fp32", progress=False)  # an interruption after step 1
    rest, straight = losses(resumed.run()), losses(Trainer(mixed_config, tmp_path / "b", progress=False).run())
    assert [first[1], *rest] == straight

    def moved(params):
        matrices = [(np.asarray(x, np.float32), s) for x, s in zip(jax.tree.leaves(params), start) if x.ndim == 2]
        return np.mean([np.mean(x != s) for x, s in matrices])

    assert moved(plain.state.params) < 0.2 and moved(resumed.state.params) > 0.95
    _, model, _ = load_trained(tmp_path / "fp32")
    bf16 = [x.astype("bfloat16") for x in jax.tree.leaves(resumed.state.params)]
    for got, mine, want in zip(jax.tree.leaves(model), jax.tree.leaves(resumed.model()), bf16, strict=True):
        assert got.dtype == mine.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(mine, want)

"""Uptraining a model trained here: convert, evaluate, train, evaluate; the run resumes bit for bit and
reads like any run."""

import json

import jax
import numpy as np
import pytest

from kvjax.commands import main
from kvjax.config import ConfigError
from kvjax.training.loading import load_model
from kvjax.training.trainer import Trainer, load_trained
from kvjax.training.uptrain import uptrain

SHORT = ["train.steps=6", "train.warmup_steps=1", "train.checkpoint_every=3", "train.eval_every=6"]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A 2-layer GQA run trained for 8 steps on a tiny corpus."""
    from kvjax.config import load_config
    from tests.training.conftest import SMALL_RUN

    config = load_config(
        "gqa",
        [
            *SMALL_RUN,
            "train.batch_size=4",
            "train.steps=8",
            "train.warmup_steps=1",
            "train.log_every=1000",
        ],
    )
    run_dir = tmp_path_factory.mktemp("source")
    Trainer(config, run_dir, progress=False).run()
    return str(run_dir)


def test_uptraining_records_source_converted_and_trained_scores(source_run, tmp_path):
    record = uptrain(source_run, "mqa", tmp_path / "up", SHORT, progress=False, log=lambda _: None)
    assert record["kv_bytes_per_token"]["converted"] * 2 == record["kv_bytes_per_token"]["source"]  # 2 -> 1 KV heads
    assert record["after"]["step"] == 6 and record["tokens"] == 6 * 4 * 32
    assert record["after"]["eval_loss"] != record["before"]["eval_loss"]
    assert json.loads((tmp_path / "up" / "uptrain.json").read_text()) == record
    again = uptrain(source_run, "mqa", tmp_path / "up", SHORT, progress=False, log=lambda _: None)
    assert again["train_seconds"] == record["train_seconds"] and again["after"] == record["after"]  # nothing trained
    loaded = load_model(str(tmp_path / "up"))  # an ordinary run: kvjax eval / generate read it
    assert loaded.config.model.attention.n_kv_heads == 1 and loaded.context == 32


def test_no_reduction_starts_where_the_source_is(source_run, tmp_path):
    record = uptrain(
        source_run, "gqa:kv_heads=2", tmp_path / "same", SHORT, progress=False, log=lambda _: None, stop_at=1
    )
    np.testing.assert_allclose(record["before"]["eval_loss"], record["source_eval"]["eval_loss"], rtol=1e-6)


def test_an_interrupted_uptraining_resumes_bit_for_bit(source_run, tmp_path):
    quiet = dict(progress=False, log=lambda _: None)
    uptrain(source_run, "cla2", tmp_path / "whole", SHORT, **quiet)
    uptrain(source_run, "cla2", tmp_path / "split", SHORT, stop_at=3, **quiet)
    uptrain(source_run, "cla2", tmp_path / "split", SHORT, **quiet)
    whole, split = (jax.tree.leaves(load_trained(tmp_path / d)[1]) for d in ("whole", "split"))
    for a, b in zip(whole, split):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match="uptrains .* by .cla2., not"):
        uptrain(source_run, "mqa", tmp_path / "split", SHORT, **quiet)


def test_bad_requests_fail_before_training(source_run, tmp_path):
    with pytest.raises(ConfigError, match="cannot map 2 KV heads"):
        uptrain(source_run, "gqa:kv_heads=3", tmp_path / "x", SHORT, progress=False)
    with pytest.raises(ConfigError, match="the model is the converted source"):
        uptrain(source_run, "mqa", tmp_path / "x", ["model.d_model=64"], progress=False)
    assert not (tmp_path / "x").exists()


def test_the_command_prints_the_three_scores(source_run, tmp_path, capsys):
    assert main(["uptrain", source_run, "mqa", *SHORT, "--run-dir", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "mqa, converted" in out and "mqa, after 6 steps" in out and "KV B/token" in out
    assert main(["uptrain", source_run, "mqa:pool=max", "--run-dir", str(tmp_path / "bad")]) == 2
    assert "pool='max' must be one of" in capsys.readouterr().err


def test_training_only_the_converted_kv_parameters(source_run, tmp_path):
    """train.trainable=kv: K/V projections and norms move, every other parameter stays the converted one."""
    from flax import nnx

    from kvjax.training.convert import convert, parse_conversion

    uptrain(source_run, "cla2", tmp_path / "kv", [*SHORT, "train.trainable=kv"], progress=False, log=lambda _: None)
    start = nnx.state(convert(load_model(source_run).model, parse_conversion("cla2")))
    end = nnx.state(load_trained(tmp_path / "kv")[1])
    moved = {
        "/".join(map(str, path)): not np.array_equal(a, b)
        for (path, a), (_, b) in zip(nnx.to_flat_state(start), nnx.to_flat_state(end))
    }
    kv = {k for k in moved if {"k", "v", "kv_norm"} & set(k.split("/"))}
    assert kv and all(moved[k] for k in kv)
    assert not any(moved[k] for k in moved if k not in kv)


@pytest.mark.slow
def test_the_uptrain_experiment_compares_converted_uptrained_and_scratch(tmp_path, capsys):
    """`kvjax compare --experiment FILE --quick` on a file naming conversions: source, and per
    conversion the converted, uptrained and from-scratch rows (scratch on source + uptraining tokens)."""
    from tests.training.conftest import SMALL_CORPUS

    exp = tmp_path / "up.yaml"
    exp.write_text(
        json.dumps(
            {
                "source": "mha",
                "conversions": ["mla:d_c=16,rope_dims=4"],
                "source_overrides": [
                    "model.n_layers=2",
                    f"data.corpus={SMALL_CORPUS}",
                    "data.seq_len=32",
                    "data.val_fraction=0.3",
                    "train.batch_size=4",
                    "train.steps=6",
                    "train.warmup_steps=1",
                ],
                "uptrain_overrides": ["train.steps=3", "train.warmup_steps=0"],
                "quick": ["data.eval_windows=4"],
                "decode_batch": 2,
                "decode_context": 48,
                "decode_tokens": 8,
            }
        )
    )
    assert main(["compare", "--experiment", str(exp), "--quick", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "up.json").read_text())["rows"]
    assert [r["model"] for r in rows] == [
        "mha (source)",
        *(f"mla:d_c=16,rope_dims=4, {k}" for k in ("converted", "uptrained", "from scratch")),
    ]
    assert rows[2]["tokens_trained"] == 3 * 4 * 32 and rows[3]["tokens_trained"] == (6 + 3) * 4 * 32
    # 2 layers x (16-dim latent + 8 KV heads x 4 RoPE dims) x fp32, against 2 x 2 x 8 x 16 x 4 for MHA
    assert (rows[1]["kv_bytes_per_token"], rows[0]["kv_bytes_per_token"]) == (2 * (16 + 8 * 4) * 4, 2 * 2 * 8 * 16 * 4)
    mla = load_model(str(tmp_path / "out" / "mla_d_c_16_rope_dims_4")).config.model.mla  # calibrated on the corpus
    assert mla.rope_heads == 8 and len(mla.rope_pairs) == 2
    assert all(r["decode_tokens_per_s"] > 0 and np.isfinite(r["val_nll"]) for r in rows)
    assert "from scratch" in capsys.readouterr().out


def test_a_target_model_config_names_the_conversion(source_run, tmp_path):
    """TARGET may be a model config of the source's shape: its KV sharing becomes the conversion."""
    target = tmp_path / "cla.yaml"
    target.write_text("base: gqa.yaml\nmodel:\n  n_layers: 2\n  kv_sharing: {kind: cla, factor: 2}\n")
    record = uptrain(source_run, str(target), tmp_path / "up", SHORT, progress=False, log=lambda _: None, stop_at=1)
    assert load_model(str(tmp_path / "up")).config.model.kv_source == (0, 0)
    assert record["kv_bytes_per_token"]["converted"] * 2 == record["kv_bytes_per_token"]["source"]
    with pytest.raises(ConfigError, match="differs from the source in model.n_layers 2 -> 4"):
        uptrain(source_run, "mqa-cla2", tmp_path / "x", SHORT, progress=False)


def test_a_shorter_run_scales_its_warm_up_unless_given():
    """`kvjax uptrain smollm2 mqa train.steps=5` once failed on the hidden default warmup_steps=10."""
    from types import SimpleNamespace

    from kvjax.config import load_config
    from kvjax.training.uptrain import uptrain_config

    loaded = SimpleNamespace(config=load_config("gqa"), corpus="kjv")
    model = loaded.config.model
    imported = uptrain_config("smollm2", loaded, model, [])
    assert (imported.train.steps, imported.train.warmup_steps, imported.train.keep_checkpoints) == (100, 10, 1)
    assert uptrain_config("smollm2", loaded, model, ["train.steps=5"]).train.warmup_steps == 1
    assert uptrain_config("smollm2", loaded, model, ["train.steps=1000"]).train.warmup_steps == 100
    assert uptrain_config("smollm2", loaded, model, ["train.steps=50", "train.warmup_steps=0"]).train.warmup_steps == 0

"""The `kvjax` training commands end to end: train, eval, generate, compare."""

import csv
import dataclasses
import json

import jax
import numpy as np
import pytest
import yaml

from kvjax.commands import main
from kvjax.config import ConfigError, load_config
from kvjax.training.compare import (
    Row,
    front_line,
    load_experiment,
    mean_interval,
    pareto_front,
    selection_windows,
    separation,
    speed,
)
from kvjax.training.trainer import Trainer, prepare_corpus
from tests.training.conftest import SMALL_CORPUS

TINY = [
    "model.n_layers=2",
    f"data.corpus={SMALL_CORPUS}",
    "data.seq_len=32",
    "data.val_fraction=0.3",
    "data.eval_windows=8",
    "train.batch_size=4",
    "train.steps=6",
    "train.warmup_steps=1",
    "train.eval_every=3",
    "train.checkpoint_every=3",
]


def test_train_eval_generate(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["train", "gqa", *TINY, "--run-dir", run]) == 0
    out = capsys.readouterr().out
    final = json.loads(out.strip().splitlines()[-1])
    assert final["step"] == 6 and final["eval_bpb"] > 0
    assert main(["eval", run, "--windows", "8"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert main(["generate", run, "--prompt", "import ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("import ")
    # Resuming a finished run does nothing more and still reports.
    assert main(["train", "gqa", *TINY, "--run-dir", run]) == 0
    assert "from step 6 of 6" in capsys.readouterr().out


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert main(["train", "gqa", "data.corpus=nope", "--run-dir", str(tmp_path)]) == 2
    assert "corpus='nope' must be one of" in capsys.readouterr().err
    assert main(["train", "gqa", "mqa"]) == 2


@pytest.mark.slow
def test_compare_quick_end_to_end(tmp_path, capsys):
    """One comparison with every option (a compile-bound run: one test instead of three): a variant with
    a cache that grows and one with a state only (the bytes of latents, rings, CLA and YOCO are checked
    in tests/kvjax/test_memory.py and tests/architectures/test_yoco.py), two seeds with their intervals,
    an LR grid that selects on a split it does not report, matched parameters, decode curves."""
    exp_file = tmp_path / "tiny.yaml"  # the shipped experiment at the unit tests' shape and corpus
    exp_file.write_text(
        yaml.safe_dump(
            {
                "base": "compare.yaml",
                "overrides": [*load_experiment().overrides, *TINY[:4], "train.batch_size=4"],
                "decode_batch": 2,
                "decode_context": 64,
                "decode_tokens": 4,
            }
        )
    )
    exp = load_experiment(exp_file)
    cfg = load_config("gqa", [*exp.overrides, *exp.quick])
    corpus = prepare_corpus(cfg)
    selection = selection_windows(corpus, cfg.data)
    reported = corpus.val[: cfg.data.eval_windows]
    assert len(selection) and not any((w == reported).all(axis=1).any() for w in selection)
    small = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_windows=10_000))
    with pytest.raises(ConfigError, match="selects on validation windows after"):
        selection_windows(corpus, small.data)

    variants = ["gqa", "rwkv7"]
    options = [
        "--experiment",
        str(exp_file),
        "--seeds",
        "2",
        "--lr-grid",
        "1e-5",
        "2e-2",
        "--match-params",
        "--decode-contexts",
        "64",
        "128",
    ]
    assert main(["compare", "--quick", "--out", str(tmp_path), "--variants", *variants, *options]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "tiny.csv")))  # --out is used as given
    assert [r["variant"] for r in rows] == variants and "| rwkv7 " in out
    assert all(r["cache_bytes_analytic"] == r["cache_bytes_measured"] for r in rows)
    assert len({r["tokens_trained"] for r in rows}) == 1  # the same budget for every variant
    record = json.loads((tmp_path / "tiny.json").read_text())
    gqa, rwkv7 = record["rows"]
    assert rwkv7["kv_bytes_per_token"] == 0 and rwkv7["state_bytes_per_sequence"] > 0 < gqa["kv_bytes_per_token"]
    # rwkv7's FFN set so that its parameters are gqa's
    assert rwkv7["ffn_dim"] != gqa["ffn_dim"] and abs(rwkv7["params"] - gqa["params"]) < 0.01 * gqa["params"]
    assert "| ffn " in out and "lr (grid)" in out and "gqa vs rwkv7: " in out and "2 seeds, 95%" in out
    for row in record["rows"]:
        grid = {float(k): v for k, v in row["lr_selection"].items()}
        assert set(grid) == {1e-5, 2e-2} and row["lr"] == min(grid, key=grid.get)
        assert row["seeds"] == [0, 1] and len(set(row["val_bpb_seeds"])) == 2  # the seeds really differ
        assert row["val_bpb"] == pytest.approx(np.mean(row["val_bpb_seeds"])) and row["val_bpb_interval"] > 0
        assert set(row["decode_curve"]) == {"64", "128"} and min(row["decode_curve"].values()) > 0
        assert len(row["decode_tokens_per_s_rounds"]) == 1 and "(1 round)" in out  # --quick: one timed round
    gqa_run = tmp_path / f"gqa-lr{gqa['lr']:g}"
    assert (gqa_run / "checkpoints").is_dir() and (tmp_path / f"gqa-lr{gqa['lr']:g}-seed1" / "checkpoints").is_dir()
    assert (tmp_path / "lr-grid" / "gqa-lr1e-05").is_dir()
    assert record["environment"]["jax"] == jax.__version__ and record["environment"]["platform"] == "cpu"
    for plot in ("tiny.png", "tiny-decode.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = Trainer(
        load_config("gqa", [*exp.overrides, *exp.quick, f"train.lr={gqa['lr']}", "train.seed=1"]),
        tmp_path / "again",
        progress=False,
    )
    again.run()  # the same seed reproduces its run bit for bit
    assert again.evaluate()["eval_bpb"] == gqa["val_bpb_seeds"][1]
    capsys.readouterr()
    assert main(["compare", "--quick", "--out", str(tmp_path), "--variants", "gqa", *options]) == 0  # all reused
    out = capsys.readouterr().out
    assert f"[1/1] gqa (seed 0): reusing the finished run in {gqa_run} (10 steps)" in out
    assert "(seed 1): reusing" in out and ": training" not in out


def test_intervals_separation_and_pareto_front_on_known_numbers():
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)  # t(0.975, 2) s / sqrt(n)
    assert mean_interval([2.5]) == (2.5, 0.0)

    def row(name, values):
        mean, half = mean_interval(values)
        return Row(name, 0, 0, 0, 0, 0, 0, mean, 0.0, 0.0, half, tuple(values))

    rows = [row("a", [2.00, 2.01, 2.02]), row("b", [2.10, 2.11, 2.12]), row("c", [2.005, 2.03, 2.0]), row("d", [2.5])]
    assert separation(rows, ()) == [("a", "b", "separated"), ("a", "c", "not separated"), ("a", "d", "one seed")]
    assert separation(rows, [("b", "c")]) == [("b", "c", "separated")]
    assert pareto_front([(4.0, 2.0), (1.0, 3.0), (2.0, 2.5), (3.0, 2.6), (8.0, 1.9)]) == [1, 2, 0, 4]
    # A front of one point (the smallest cache is also the best) is still a line to the largest cache.
    assert front_line([(1.0, 2.0), (4.0, 2.5)]) == ([1.0, 4.0], [2.0, 2.0])
    assert speed((100.0,)) == "~100 (1 round)" and speed((90.0, 100.0, 110.0)) == "100 +-10%"


def test_compare_variants_are_checked_before_training(tmp_path, capsys):
    assert main(["compare", "--quick", "--out", str(tmp_path), "--variants", "gqa", "cla9"]) == 2
    assert "config 'cla9' is neither a file nor a shipped model config" in capsys.readouterr().err
    assert not (tmp_path / "gqa").exists()


def test_experiments_by_name_inherit_the_budget(tmp_path):
    mine = tmp_path / "mine.yaml"  # a user's experiment outside configs/ may inherit a shipped one
    mine.write_text("base: compare.yaml\nvariants: [gqa, mla]\n")
    assert load_experiment(str(mine)).variants == ("gqa", "mla")
    assert load_experiment(str(mine)).overrides == load_experiment().overrides
    default, sharing = load_experiment(), load_experiment("sharing")
    assert sharing.variants == ("gqa", "mqa", "cla2", "mqa-cla2", "cla3", "mlkv-2", "mlkv-1")
    assert sharing.overrides == default.overrides and sharing.quick == default.quick
    with pytest.raises(ConfigError, match="neither a file nor a shipped experiment"):
        load_experiment("sharnig")


def test_match_params_gives_each_variant_the_first_ones_parameter_count(monkeypatch):
    """--match-params: ffn_dim per variant, nearest the reference's count (within half a step of
    ffn_dim); the reference is untouched; impossible matches are clear errors."""
    import kvjax.training.compare as compare

    overrides = load_experiment("study").overrides
    configs = {v: load_config(v, overrides) for v in ("gqa", "mqa-cla2", "yoco-gret", "rwkv7", "retnet")}
    matched = compare.match_params(configs)
    target = compare.count_params(configs["gqa"].model)
    assert matched["gqa"] is configs["gqa"]
    for variant, cfg in matched.items():
        step = compare.count_params(
            dataclasses.replace(cfg.model, ffn_dim=cfg.model.ffn_dim + 1)
        ) - compare.count_params(cfg.model)
        assert abs(compare.count_params(cfg.model) - target) <= step / 2, variant
        assert dataclasses.replace(cfg.model, ffn_dim=512) == configs[variant].model  # nothing else changes
    assert matched["retnet"].model.ffn_dim < 512 < matched["mqa-cla2"].model.ffn_dim
    tiny = {"gqa": load_config("gqa", [*overrides, "model.ffn_dim=8"]), "retnet": configs["retnet"]}
    with pytest.raises(ConfigError, match=r"retnet would need model.ffn_dim=-\d+ \(< 1\)"):
        compare.match_params(tiny)
    monkeypatch.setattr(compare, "count_params", lambda cfg: 1000 if cfg.name == "gqa" else 900)
    with pytest.raises(ConfigError, match="mqa-cla2's parameters do not depend on model.ffn_dim"):
        compare.match_params(configs)

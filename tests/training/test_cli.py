"""The `kvjax` training commands end to end: train, eval, generate, compare."""

import csv
import json

import pytest

from kvjax.cli import main
from kvjax.config import ConfigError
from training.compare import load_experiment
from tests.training.conftest import SMALL_CORPUS

TINY = [
    "model.n_layers=2", f"data.corpus={SMALL_CORPUS}", "data.seq_len=32", "data.val_fraction=0.3",
    "data.eval_windows=8", "train.batch_size=4", "train.steps=6", "train.warmup_steps=1",
    "train.eval_every=3", "train.checkpoint_every=3",
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
    """One variant per kind of cache (dense, latent, state only), trained, measured and written (the
    bytes of rings, CLA and YOCO: tests/kvjax/test_memory.py, tests/architectures/test_yoco.py)."""
    variants = ["gqa", "mla", "rwkv7"]
    assert main(["compare", "--quick", "--out", str(tmp_path), "--variants", *variants]) == 0
    out_dir = tmp_path  # --out is used as given
    rows = list(csv.DictReader(open(out_dir / "compare.csv")))
    assert [r["variant"] for r in rows] == variants
    assert all(r["cache_bytes_analytic"] == r["cache_bytes_measured"] for r in rows)
    assert len({r["tokens_trained"] for r in rows}) == 1  # the same budget for every variant
    by = {r["variant"]: {k: float(v) for k, v in r.items() if k != "variant"} for r in rows}
    assert 4 * by["mla"]["kv_bytes_per_token"] == by["gqa"]["kv_bytes_per_token"]
    assert by["rwkv7"]["kv_bytes_per_token"] == 0 and by["rwkv7"]["state_bytes_per_sequence"] > 0
    assert json.loads((out_dir / "compare.json").read_text())["rows"][0]["variant"] == "gqa"
    assert (out_dir / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rwkv7 " in capsys.readouterr().out
    assert main(["compare", "--quick", "--out", str(tmp_path), "--variants", "gqa"]) == 0  # reused, not retrained
    assert f"[1/1] gqa: reusing the finished run in {tmp_path / 'gqa'} (10 steps)" in capsys.readouterr().out


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

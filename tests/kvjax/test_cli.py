import pytest

from kvjax import memory
from kvjax.cli import main
from kvjax.config import load_config


def rows_by_variant(out: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}


def test_memory_table_over_shipped_configs(capsys):
    assert main(["memory", "mha", "gqa", "mqa", "swa", "cla2", "mla", "yoco-gret"]) == 0
    rows = rows_by_variant(capsys.readouterr().out)
    assert set(rows) == {"mha", "gqa", "mqa", "swa", "cla2", "mla", "yoco-gret"}
    # layers, KV layers, KV heads, head dim, dtype, KV B/token, cache B/token, state B/seq
    assert rows["gqa"][1:9] == ["4", "4", "2", "16", "float32", "1024", "1040", "16"]
    assert rows["cla2"][1:9] == ["4", "2", "2", "16", "float32", "512", "520", "8"]
    assert rows["mla"][1:9] == ["4", "4", "latent", "12+4", "float32", "256", "272", "16"]
    assert rows["swa"][6:9] == ["0", "0", str(4 * (64 * 260 + 4))]  # rings are per-sequence, not per-token
    assert rows["yoco-gret"][2] == "1" and rows["yoco-gret"][8] == str(2 * 8 * 16 * 16 * 4 + 4)
    assert rows["mha"][-1] == "1.0000"
    gqa = load_config("gqa").model
    ratio = memory.cache_bytes(gqa, 32768) / memory.cache_bytes(load_config("mha").model, 32768)
    assert rows["gqa"][-1] == f"{ratio:.4f}"
    assert rows["swa"][9] == rows["swa"][10]  # the window caps the cache: 4k and 32k take the same bytes


def test_memory_applies_overrides_and_reports_errors(capsys):
    assert main(["memory", "gqa", "model.n_layers=8", "--tokens", "1024"]) == 0
    assert "| gqa " in capsys.readouterr().out
    assert main(["memory", "gqa", "model.attention.n_kv_heads=3"]) == 2
    assert "n_kv_heads=3 must divide" in capsys.readouterr().err
    assert main(["memory", "model.n_layers=2"]) == 2
    with pytest.raises(SystemExit, match="2"):
        main(["memory", "gqa", "--batch", "0"])
    assert "argument --batch: 0 must be >= 1" in capsys.readouterr().err

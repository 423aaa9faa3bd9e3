import re

import jax
import numpy as np
import pytest

from kvjax import memory
from kvjax.commands import main
from kvjax.config import ConfigError, load_config


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


def test_compiled_generation_holds_what_its_budget_counts(capsys):
    """`kvjax memory --compiled`: the weights counted equal the model's, the compiled programs take
    exactly the weights, the caches and the step's small inputs, write the caches in place (donated),
    and a chunk over an 8,192-slot cache holds scores a key block at a time (one softmax over every key
    holds more than one [C, S] fp32 score matrix per query head)."""
    from flax import nnx

    from kvjax import footprint
    from kvjax.architectures import Decoder

    cfg = load_config("gqa").model
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    caches, (B, S, C, V, D) = memory.cache_bytes(cfg, 8192, 2), (2, 8192, 512, cfg.vocab_size, cfg.d_model)
    prefill, decode = footprint.compiled(model, B, S, C)
    budget = footprint.budgets(model, B, S, C)
    assert budget[0].weights == footprint.weight_bytes(model) == weights and budget[0].caches == caches
    assert prefill.arguments == weights + caches + B * D * 4 + B * C * 4 + B * 4 + 4  # hidden, tokens, lengths, start
    assert prefill.aliased == caches + B * D * 4
    assert decode.arguments == weights + caches + B * V * 4 + B * 4 + 8 + 4  # logits, lengths, key, new tokens
    assert decode.aliased == caches
    assert prefill.temporaries < min(1.6 * budget[0].activations, B * cfg.attention.n_heads * C * S * 4)
    assert decode.temporaries < 1.6 * budget[1].activations
    assert main(["memory", "gqa", "--tokens", "8192", "--batch", "2", "--chunk", "512", "--compiled"]) == 0
    out = capsys.readouterr().out
    assert "compiled for this host's cpu backend" in out
    row = [c.strip() for c in next(line for line in out.splitlines() if "prefill chunk of 512" in line).split("|")]
    assert row[1:5] + row[-3:-1] == ["8192", "prefill chunk of 512", "3.0 MiB", "16.3 MiB"] + [
        footprint.gib(prefill.peak),
        f"{prefill.peak / budget[0].total:.2f}",
    ]


def test_serve_bench_compares_servers_at_one_budget(tmp_path, capsys):
    """`kvjax serve-bench`: static batches, the engine and the engine with int:8 and Palu at the same K/V bytes
    (by default what static batches need for a quarter of the requests, here 2 of 5); the JSON has every
    figure, the budget buys more int8 pages, and int:8's served continuations carry their KL. The prompts
    are passages of the KJV's validation text (in bytes), the shared prefix one passage."""
    import json

    from kvjax.serve_bench import Workload, default_memory
    from kvjax.training.compression_eval import corpus_tokens
    from kvjax.training.tokenizer import ByteTokenizer

    out = tmp_path / "serve.json"
    args = [
        "serve-bench",
        "gqa",
        "model.n_layers=2",
        "--requests",
        "5",
        "--prompt",
        "9",
        "16",
        "--new",
        "2",
        "6",
        "--page-size",
        "4",
        "--slots",
        "3",
        "--chunk",
        "16",
        "--shared-prefix",
        "3",
        "--prompts",
        "kjv",
        "--policy",
        "int:8",
        "--policy",
        "palu:0.5",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    figures = json.loads(out.read_text())
    static, engine, int8, palu = figures["servers"]
    assert [s["server"] for s in figures["servers"]] == ["static batches", "engine", "engine", "engine"]
    assert int8["policy"] == "int:8" and int8["pages"] > 3 * engine["pages"]  # codes + scales: < 1/3 the bytes
    # Palu's latent pages, its bases calibrated on KJV's training split: half the K/V a token, plus positions
    assert palu["policy"] == "palu:0.5" and 1.5 * engine["pages"] < palu["pages"] <= 2 * engine["pages"]
    assert palu["kl_positions"] == figures["new_tokens"] - 5 and palu["kl_vs_full"] > 0
    budget = figures["kv_budget_bytes"]
    for s in (engine, int8, palu):
        assert s["pages"] * s["page_bytes"] <= budget < (s["pages"] + 1) * s["page_bytes"]
        assert s["peak_pages"] <= s["pages"]
        assert s["prefill_tokens"] + s["cached_tokens"] >= figures["prompt_tokens"]
    workload = Workload(requests=5, prompt=(9, 16), new=(2, 6), shared_prefix=3)
    text = corpus_tokens(ByteTokenizer(), "kjv")
    requests = workload.sample(258, text)
    assert figures["prompts"] == "from kjv" and figures["workload"] == json.loads(json.dumps(vars(workload)))
    stream = bytes(int(t) for t in text)
    for r in requests:  # a shared passage, then a passage of each request's own
        assert r.prompt[:3] == requests[0].prompt[:3] and bytes(r.prompt[3:]) in stream
    assert bytes(requests[0].prompt[:3]) in stream
    assert requests[0].prompt[3:] != requests[1].prompt[3:]
    assert budget == int(default_memory(load_config("gqa", ["model.n_layers=2"]).model, workload, text) * 2**20)
    assert static["rows_in_memory"] == 2
    assert figures["new_tokens"] == sum(r.decoding.max_new_tokens for r in requests)
    assert static["bytes_allocated"] <= budget and 1 <= static["concurrent"] <= 5  # rows that ran, not that fit
    assert static["concurrent"] == min(static["rows_in_memory"], 5)
    # int:8's quality cost on what it served: every served token but each request's first is scored
    assert int8["kl_positions"] == figures["new_tokens"] - 5 and 0 < int8["kl_vs_full"] < 1e-2
    assert "kl_vs_full" not in engine
    table = capsys.readouterr().out
    assert "| engine + int:8 " in table and "KL vs full" in table


def test_serve_bench_compares_architectures_at_one_budget(tmp_path, capsys):
    """Several models at one budget on a named workload (its lengths overridden):
    each model's table, then one row per model; Mamba's budget buys states, so it runs as many requests
    as they fit, and holds no K/V per token. A policy one of the models cannot take fails before any
    compute."""
    import json

    from kvjax.memory import state_bytes_per_sequence

    out = tmp_path / "serve.json"
    args = ["serve-bench", "gqa", "mamba", "model.n_layers=2", "--workload", "long-generation"]
    args += ["--requests", "3", "--prompt", "8", "16", "--new", "4", "8", "--page-size", "4", "--memory-mib", "0.1"]
    args += ["--json", str(out)]
    assert main(args) == 0
    runs = json.loads(out.read_text())
    assert [r["model"] for r in runs] == ["gqa", "mamba"] and runs[0]["kv_budget_bytes"] == runs[1]["kv_budget_bytes"]
    assert runs[1]["workload"] == {"requests": 3, "prompt": [8, 16], "new": [4, 8], "shared_prefix": 0, "seed": 0}
    mamba = runs[1]
    state = state_bytes_per_sequence(load_config("mamba", ["model.n_layers=2"]).model)
    assert mamba["kv_bytes_per_token"] == 0 and mamba["state_bytes_per_sequence"] == state
    assert mamba["servers"][1]["concurrent"] <= mamba["kv_budget_bytes"] // state
    table = rows_by_variant(capsys.readouterr().out.split("Every model at", 1)[1])
    assert set(table) == {"gqa", "mamba"} and table["mamba"][1:3] == ["0", f"{state:,}"]
    assert main(["serve-bench", "gqa", "mamba", "--policy", "snapkv:0.5"]) == 2
    err = capsys.readouterr().err
    assert "'mamba' has no cache that grows with the sequence" in err and "first pass" not in err


def test_serve_bench_checks_its_arguments(capsys):
    from kvjax.serve_bench import Workload

    assert main(["serve-bench", "gqa", "--prompt", "9", "3"]) == 2
    assert "--prompt 9 3: need 1 <= low <= high" in capsys.readouterr().err
    assert main(["serve-bench", "gqa", "--prompts", "bible"]) == 2
    assert "--prompts bible: corpus='bible' must be one of" in capsys.readouterr().err
    assert main(["serve-bench", "gqa", "--prompts", ""]) == 2
    assert "--prompts is empty: give random or a corpus" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="the text has 20 tokens, fewer than a prompt of 4 shared [+] 17 of its own"):
        Workload(prompt=(2, 17), shared_prefix=4).sample(8, np.arange(20))
    assert main(["serve-bench", "gqa", "--policy", "int:4:asym=true", "--memory-mib", "1"]) == 2
    assert "quantized pages are int:8, int:4 (symmetric), kivi, kvquant or gear only" in capsys.readouterr().err
    assert main(["serve-bench", "gqa", "--policy", "kivi:2", "--memory-mib", "1"]) == 2  # pages of 16
    err = capsys.readouterr().err
    assert "divides the residual (128): one of [32, 64, 128], not 16" in err and "first pass" not in err
    assert main(["serve-bench", "gqa", "--policy", "duo:0.5", "--memory-mib", "1"]) == 2  # the model's own pattern
    err = capsys.readouterr().err
    assert re.search(r"no learned pattern at \S*configs/duo/gqa[^ ]*\.json", err) and "first pass" not in err
    assert main(["serve-bench", "gqa", "--memory-mib", "0.001"]) == 2
    assert re.search(
        r"hold no static row of \d+ tokens; the least that holds one is [\d.]+ MiB", capsys.readouterr().err
    )

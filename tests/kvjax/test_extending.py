"""docs/extending.md's worked examples are code that runs: its first block registers a new scoring
method, which then passes the contract of every registered method and runs from a policy string; its
second a new layer kind, which passes the contract of every registered kind; its third is the Qwen3
family file itself."""

import re
from pathlib import Path

import numpy as np
import pytest

from kvjax import DecodingConfig, Generator, memory
from kvjax.architectures.mixers import MIXERS
from kvjax.compress import parse_policy
from kvjax.compress.methods import METHODS
from kvjax.config import ConfigError
from kvjax.engine import Engine
from kvjax.kinds import KINDS
from kvjax.training.families import BY_HF_ARCHITECTURE
from tests.architectures.test_kinds import check_kind
from tests.kvjax.test_methods import CAPACITY, PROMPTS, check_contract, model  # noqa: F401 (a fixture)

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3, "docs/extending.md: a method example, a layer kind example, then a model family"
    return blocks


def test_the_documented_model_family_is_the_shipped_file():
    """The family example is training/families/qwen3.py itself, which the import tests run (see the doc)."""
    assert _blocks()[2] == (DOC.parents[1] / "training" / "families" / "qwen3.py").read_text()
    assert BY_HF_ARCHITECTURE["Qwen3ForCausalLM"].__name__ == "kvjax.training.families.qwen3"


def test_the_documented_method_is_one_block_that_passes_the_contract(model):  # noqa: F811
    block = _blocks()[0]
    try:
        exec(compile(block, str(DOC), "exec"), {})
        assert "ignored" in METHODS
        check_contract(model, "ignored")
        out = Generator(model, capacity=CAPACITY, policy=parse_policy("ignored:0.5:queries=4"))(
            PROMPTS, DecodingConfig(max_new_tokens=2)
        )
        assert np.isfinite(out.logprobs).all()
        with pytest.raises(ConfigError, match="queries=0 must be >= 1"):
            parse_policy("ignored:0.5:queries=0")
    finally:
        METHODS.pop("ignored", None)  # the registry is global: leave it as the other tests expect


def test_the_documented_layer_kind_is_one_block_that_passes_the_contract(make_model):
    try:
        exec(compile(_blocks()[1], str(DOC), "exec"), {})
        check_kind(make_model, "shift")
        cfg, _ = make_model("gqa", "model.n_layers=4", "model.layer_pattern=[shift, attention]")
        assert cfg.mixers == ("shift", "attention") * 2 and memory.state_bytes_per_sequence(cfg) > 0
        with pytest.raises(ConfigError, match=r"model mixers \['shift'\] are not supported yet"):
            Engine(make_model("gqa", "model.n_layers=2", "model.layer_pattern=[shift, attention]")[1], n_pages=8)
    finally:  # the registries are global: leave them as the other tests expect
        KINDS.pop("shift", None)
        MIXERS.pop("shift", None)

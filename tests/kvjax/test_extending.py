"""docs/extending.md's worked example is code that runs: its block registers a new scoring method,
which then passes the contract of every registered method and runs from a policy string."""

import re
from pathlib import Path

import numpy as np

from kvjax import DecodingConfig, Generator
from kvjax.compress import parse_policy
from kvjax.compress.methods import METHODS
from tests.kvjax.test_methods import CAPACITY, PROMPTS, check_contract, model  # noqa: F401 (a fixture)

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def test_the_documented_method_is_one_block_that_passes_the_contract(model):  # noqa: F811
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    try:
        exec(compile(block, str(DOC), "exec"), {})
        assert "ignored" in METHODS
        check_contract(model, "ignored")
        out = Generator(model, capacity=CAPACITY, policy=parse_policy("ignored:0.5"))(
            PROMPTS, DecodingConfig(max_new_tokens=2)
        )
        assert np.isfinite(out.logprobs).all()
    finally:
        METHODS.pop("ignored", None)  # the registry is global: leave it as the other tests expect

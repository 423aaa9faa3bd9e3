"""The contract every registered token-level scoring method passes, parametrized over the registry (no
hand-kept list: a method added to kvjax/compress/methods/ is held to it at once): a budget that covers
the prompt changes nothing, measured bytes equal analytic bytes, generation equals teacher-forced
scoring through the same compressed cache, and a bad option is a one-line error before compute."""

import dataclasses
import inspect

import jax
import numpy as np
import pytest

from kvjax import DecodingConfig, Generator
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy, plan_stages
from kvjax.compress.methods import METHODS
from kvjax.compress.policy import Policy, all_methods, options_class
from kvjax.config import ConfigError, load_config
from kvjax.quant.schemes import SCHEMES

PROMPTS = [list(range(3, 99)), [7, 1, 9, 4] * 17 + [2, 5]]  # 96 and 70 tokens: a half still covers a 32-token window
NEW = 5
CAPACITY = 96 + NEW


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("gqa", "model.n_layers=2", "model.init_std=0.2")[1]


def scoring_methods() -> list[str]:
    return sorted(name for name, method in METHODS.items() if method.kind == "scorer")


def check_contract(model, name: str) -> None:
    full = Generator(model, capacity=CAPACITY)
    covering = Generator(model, capacity=CAPACITY, policy=parse_policy(f"{name}:0.0"))
    continuation = np.asarray(full(PROMPTS, DecodingConfig(max_new_tokens=NEW)).tokens)
    want, _ = full.score(PROMPTS, continuation.tolist())
    got, _ = covering.score(PROMPTS, continuation.tolist())
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{name}:0.0 changed the scores")

    half = Generator(model, capacity=CAPACITY, policy=parse_policy(f"{name}:0.5"))
    tokens, lengths = half.pad(PROMPTS, NEW)
    logits, caches, stats = half.prefill_compressed(tokens, lengths, NEW)
    plans = half.compression_plan(lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(model.config, plans, len(PROMPTS), CAPACITY), name
    out = half.decode(caches, logits, lengths, DecodingConfig(max_new_tokens=NEW), jax.random.key(0), stats)
    scored, _ = half.score(PROMPTS, np.asarray(out.tokens).tolist())
    np.testing.assert_allclose(scored, out.logprobs, atol=1e-5, err_msg=f"{name}: decode != teacher forcing")

    with pytest.raises(ConfigError, match=f"policy stage '{name}:0.5:colour=red': unknown option 'colour'"):
        parse_policy(f"{name}:0.5:colour=red")


@pytest.mark.parametrize("name", scoring_methods())
def test_every_registered_scoring_method_keeps_the_contract(model, name):
    check_contract(model, name)


@pytest.mark.parametrize("name", all_methods())
def test_every_method_and_quantizer_takes_its_own_options_only(name):
    """Every registered method and quantizer: a stage carries its own options dataclass at its defaults
    and prints back to itself; another method's option, or an unknown one, is a one-line error naming the
    stage and listing the method's own options."""
    budget = SCHEMES[name].bits[0] if name in SCHEMES else 0.5
    stage = parse_policy(f"{name}:{budget}").stages[0]
    own = options_class(name)
    assert type(stage.options) is own and stage.options == own()
    assert parse_policy(str(Policy((stage,)))) == Policy((stage,))
    names = [f.name for f in dataclasses.fields(own)]
    others = sorted({f.name for m in all_methods() for f in dataclasses.fields(options_class(m))} - set(names))
    for foreign in (others[0], "colour"):
        with pytest.raises(ConfigError, match=rf"'{name}:{budget}:{foreign}=1': unknown option '{foreign}'; {name}'s"):
            parse_policy(f"{name}:{budget}:{foreign}=1")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_registered_method_declares_what_it_prepares(name):
    """What `prepare` gives is a keyword `plan_stages` takes, and planning without it is an error naming
    what is missing (never a silent full cache)."""
    method = METHODS[name]
    assert set(method.prepares) <= set(inspect.signature(plan_stages).parameters), method.prepares
    if method.prepares:
        cfg = load_config("gqa", ["model.n_layers=2"]).model
        with pytest.raises(ConfigError, match=f"policy stage '{name}' needs its {method.prepares[0]}"):
            plan_stages(cfg, parse_policy(f"{name}:0.5").stages, [40], headroom=1)

"""The contract every registered token-level scoring method passes, parametrized over the registry (no
hand-kept list: a method added to kvjax/compress/methods/ is held to it at once): a budget that covers
the prompt changes nothing, measured bytes equal analytic bytes, generation equals teacher-forced
scoring through the same compressed cache, and a bad option is a one-line error before compute."""

import dataclasses
import inspect
import json

import jax
import numpy as np
import pytest

from kvjax import DecodingConfig, Generator
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy, plan_stages
from kvjax.compress.methods import METHODS
from kvjax.compress.policy import Policy, all_methods, options_class
from kvjax.config import ConfigError, load_config
from kvjax.plan import compressible, kv_heads
from kvjax.quant.schemes import SCHEMES

PROMPTS = [list(range(3, 99)), [7, 1, 9, 4] * 17 + [2, 5]]  # 96 and 70 tokens: a half still covers a 32-token window
NEW = 5
CAPACITY = 96 + NEW


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("gqa", "model.n_layers=2", "model.init_std=0.2")[1]


def check_contract(
    model, name: str, options: str = "", calibration=None, covering: str = "0.0", budget: str = "0.5"
) -> None:
    """`name` (with `options`, e.g. ":pattern=PATH") on the module's model: a `covering` budget changes
    nothing; at `budget`, measured bytes equal the analytic bytes and decode equals teacher forcing
    through the compressed cache."""
    full = Generator(model, capacity=CAPACITY)
    policy = parse_policy(f"{name}:{covering}{options}")
    covering = Generator(model, capacity=CAPACITY, policy=policy, calibration=calibration)
    continuation = np.asarray(full(PROMPTS, DecodingConfig(max_new_tokens=NEW)).tokens)
    want, _ = full.score(PROMPTS, continuation.tolist())
    got, _ = covering.score(PROMPTS, continuation.tolist())
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{name}:0.0 changed the scores")

    policy = parse_policy(f"{name}:{budget}{options}")
    half = Generator(model, capacity=CAPACITY, policy=policy, calibration=calibration)
    tokens, lengths = half.pad(PROMPTS, NEW)
    logits, caches, stats = half.prefill_compressed(tokens, lengths, NEW)
    plans = half.compression_plan(lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(model.config, plans, len(PROMPTS), CAPACITY), name
    out = half.decode(caches, logits, lengths, DecodingConfig(max_new_tokens=NEW), jax.random.key(0), stats)
    scored, _ = half.score(PROMPTS, np.asarray(out.tokens).tolist())
    np.testing.assert_allclose(scored, out.logprobs, atol=1e-5, err_msg=f"{name}: decode != teacher forcing")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_registered_method_keeps_the_contract(model, name, tmp_path):
    """Every registered method, whatever its kind (scorers, Quest, ThinK, Palu and LoRC, DuoAttention,
    MiniCache): what it prepares from the model is given (calibration tokens, a pattern of random gates).
    Quest's budget is the tokens a decode step reads, fixed at the prefill: it covers the sequence when
    it covers the decoded tokens too. MiniCache merges the top fraction of the layers in pairs: 0.9 of
    the two layers is one pair."""
    method, options, calibration = METHODS[name], "", None
    covering = str(CAPACITY) if method.kind == "selector" else "0.0"
    budget = "0.9" if method.kind == "layer_level" else "0.5"
    if method.needs_calibration:
        calibration = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 64))
    if "streaming" in method.prepares:
        heads = [kv_heads(model.config, s) for s in compressible(model.config)]
        gates = [np.random.default_rng(i).random(k).tolist() for i, k in enumerate(heads)]
        (tmp_path / "gates.json").write_text(json.dumps({"gates": gates}))
        options = f":pattern={tmp_path / 'gates.json'}"
    check_contract(model, name, options, calibration, covering, budget)


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

"""Cross-layer K/V sharing (CLA, MLKV): oracles of DESIGN.md for consumer layers that store nothing."""

import jax
import numpy as np
import pytest
from flax import nnx

from kvjax import memory
from kvjax.cache import caches_nbytes
from kvjax.plan import LayerPlan, init_caches
from tests.architectures.oracles import assert_cached_decode_equals_full_forward, tokens_and_positions

THREE_LAYERS = "model.n_layers=3"
# 3 layers: cla2 -> (0, 0, 2), cla3 -> (0, 0, 0), mlkv-2 -> (0, 1, 1), mlkv-1 -> (0, 0, 0).
SHARED = ["cla2", "mqa-cla2", "cla3", "mlkv-2", "mlkv-1"]
EXPLICIT = ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,1,0]"]


def n_params(model) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("variant", SHARED)
def test_cached_decode_equals_full_forward(make_model, variant):
    cfg, model = make_model(variant, THREE_LAYERS)
    caches = assert_cached_decode_equals_full_forward(cfg, model, prefill=9)
    assert len(caches) == len(LayerPlan.from_config(cfg).producers) < cfg.n_layers


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.kv_sharing.kind=cla", "model.kv_sharing.factor=1"],
        ["model.kv_sharing.kind=mlkv", "model.kv_sharing.n_kv_layers=3"],
        ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,1,2]"],
    ],
    ids=["cla-factor-1", "mlkv-all-layers", "explicit-identity"],
)
def test_sharing_with_every_layer_a_producer_is_the_base_model_exactly(make_model, overrides):
    cfg, base = make_model("gqa", THREE_LAYERS)
    shared_cfg, shared = make_model("gqa", THREE_LAYERS, *overrides)
    assert shared_cfg.kv_source == cfg.kv_source == (0, 1, 2)
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.state(base), nnx.state(shared)))
    tokens, pos = tokens_and_positions(cfg.vocab_size)
    np.testing.assert_array_equal(base(tokens, pos)[0], shared(tokens, pos)[0])


def test_consumers_have_no_kv_projections_and_read_their_own_producer(make_model):
    cfg, model = make_model("gqa", THREE_LAYERS, *EXPLICIT)  # layer 2 reads layer 0, not the latest (1)
    assert [b.mixer.produces_kv for b in model.blocks] == [True, True, False]
    assert model.blocks[2].mixer.k is None and model.blocks[2].mixer.v is None
    tokens, pos = tokens_and_positions(cfg.vocab_size)

    def by_hand(source):
        x = model.embed(tokens)
        x, _, view0 = model.blocks[0](x, pos)
        x, _, view1 = model.blocks[1](x, pos)
        x, _, _ = model.blocks[2](x, pos, shared=(view0, view1)[source])
        return model.logits(model.final_norm(x))

    got, _ = model(tokens, pos)
    np.testing.assert_array_equal(got, by_hand(0))
    assert not np.allclose(got, by_hand(1))
    with pytest.raises(ValueError, match="pass shared="):
        model.blocks[2](model.embed(tokens), pos)


@pytest.mark.parametrize("variant", ["gqa", *SHARED])
def test_parameter_count_matches_the_formula(make_model, variant):
    cfg, model = make_model(variant)
    att, d = cfg.attention, cfg.d_model
    producers = len(set(cfg.kv_source))
    expected = (
        cfg.vocab_size * d  # tied embedding
        + d  # final norm
        + cfg.n_layers * (2 * d * att.n_heads * att.head_dim + 3 * d * cfg.ffn_dim + 2 * d)  # q, o, MLP, norms
        + producers * 2 * d * att.n_kv_heads * att.head_dim  # k, v of producers only
        + (producers * d if cfg.kv_sharing.uses_kv_norm else 0)  # CLA's K/V-input norm
    )
    assert n_params(model) == expected


@pytest.mark.parametrize("variant", SHARED)
@pytest.mark.parametrize("capacity", [1, 100])
def test_measured_bytes_equal_analytic(variant, capacity, make_model):
    cfg, _ = make_model(variant)
    caches = init_caches(cfg, 2, capacity)
    assert caches_nbytes(caches) == memory.cache_bytes(cfg, capacity, batch=2)
    att = cfg.attention
    expected = 2 * len(set(cfg.kv_source)) * att.n_kv_heads * att.head_dim * 4
    assert memory.kv_bytes_per_token(cfg) == expected


def test_shipped_sharing_ratios():
    """The shipped variants' caches against their bases, as the papers state them."""
    from kvjax.config import load_config

    kv = {name: memory.kv_bytes_per_token(load_config(name).model) for name in ["gqa", "mqa", *SHARED]}
    assert kv["cla2"] * 2 == kv["gqa"] and kv["mqa-cla2"] * 2 == kv["mqa"]
    assert kv["cla3"] * 2 == kv["gqa"]  # 4 layers, factor 3: producers 0 and 3
    assert kv["mlkv-2"] * 2 == kv["mqa"] and kv["mlkv-1"] * 4 == kv["mqa"]

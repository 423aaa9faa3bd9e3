"""The contract every registered layer kind keeps, parametrized over the registry (no hand-kept list: a
kind added to kvjax/kinds/ with its mixer is held to it at once): cached decode equals the full forward,
and the bytes of its caches equal its memory formula, before and after decoding."""

import pytest

from kvjax.architectures.mixers import MIXERS
from kvjax.cache import caches_nbytes
from kvjax.kinds import KINDS
from kvjax.memory import cache_bytes
from kvjax.plan import init_caches
from tests.architectures.oracles import B, T, assert_cached_decode_equals_full_forward


def _model_of(make_model, kind: str):
    """Two layers of `kind`: the layer pattern, or for a kind only YOCO places, YOCO's self-decoder (8-slot
    rings, so that a sliding window wraps during the test)."""
    if KINDS[kind].in_pattern:
        return make_model("gqa", "model.n_layers=2", f"model.layer_pattern=[{kind}]")
    return make_model("yoco-swa", "model.n_layers=2", f"model.yoco.self_mixer={kind}", "model.yoco.window=8")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_registered_kind_decodes_as_its_full_forward_in_the_bytes_it_declares(make_model, kind):
    check_kind(make_model, kind)


def check_kind(make_model, kind: str) -> None:
    assert kind in MIXERS, f"layer kind {kind!r} has no mixer module (kvjax.architectures.mixers)"
    cfg, model = _model_of(make_model, kind)
    assert kind in cfg.mixers
    assert caches_nbytes(init_caches(cfg, B, T)) == cache_bytes(cfg, T, B)
    caches = assert_cached_decode_equals_full_forward(cfg, model, prefill=10)
    assert caches_nbytes(caches) == cache_bytes(cfg, T, B)

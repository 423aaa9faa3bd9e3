import pytest

from kvjax.config import ConfigError, load_config
from kvjax.plan import LayerPlan


def test_config_plan_is_every_layer_its_own_producer():
    plan = LayerPlan.from_config(load_config("gqa").model)
    assert plan.kv_source == (0, 1, 2, 3) and plan.producers == (0, 1, 2, 3)
    assert [plan.cache_index(i) for i in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "name, overrides, kv_source",
    [
        ("cla2", [], (0, 0, 2, 2)),
        ("cla3", [], (0, 0, 0, 3)),
        ("cla3", ["model.n_layers=7"], (0, 0, 0, 3, 3, 3, 6)),
        ("mlkv-2", [], (0, 0, 2, 2)),
        ("mlkv-1", [], (0, 0, 0, 0)),
        # MLKV placement [0] + [int((i+1) L/m) for i < m-1]: L=12, m=4 -> producers 0, 3, 6, 9
        ("mlkv-2", ["model.n_layers=12", "model.kv_sharing.n_kv_layers=4"], (0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9)),
        ("mlkv-2", ["model.n_layers=5", "model.kv_sharing.n_kv_layers=3"], (0, 1, 1, 3, 3)),
        ("gqa", ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,1,0,3]"], (0, 1, 0, 3)),
    ],
)
def test_sharing_configs_resolve_to_their_plan(name, overrides, kv_source):
    plan = LayerPlan.from_config(load_config(name, overrides).model)
    assert plan.kv_source == kv_source
    assert plan.producers == tuple(sorted(set(kv_source)))


def test_shared_sources_map_to_their_producer_cache():
    plan = LayerPlan(mixers=("attention",) * 4, kv_source=(0, 0, 2, 2))
    assert plan.producers == (0, 2)
    assert [plan.cache_index(i) for i in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "kv_source, message",
    [
        ((1, 1), "kv_source[0]=1 must be in [0, 0]"),
        ((0, 2, 2), "kv_source[1]=2 must be in [0, 1] (sources point back)"),
        ((0, 0, 1), "kv_source[2]=1 names layer 1, which is not a producer"),
        ((0,), "3 mixers but 1 kv_source entries"),
    ],
)
def test_invalid_plans_raise(kv_source, message):
    mixers = ("attention",) * (len(kv_source) if len(kv_source) > 1 else 3)
    with pytest.raises(ConfigError) as info:
        LayerPlan(mixers=mixers, kv_source=kv_source)
    assert message in str(info.value)


def test_unknown_mixer_kind():
    with pytest.raises(ConfigError, match="mixers\\[1\\]='lstm' must be one of"):
        LayerPlan(mixers=("attention", "lstm"), kv_source=(0, 1))

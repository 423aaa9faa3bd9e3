import dataclasses

import pytest

from kvjax.config import (
    AttentionConfig,
    Config,
    ConfigError,
    DecodingConfig,
    ModelConfig,
    apply_overrides,
    from_dict,
    load_config,
)

SHIPPED = ["mha", "gqa", "mqa", "mqa-half", "swa", "cla2", "mqa-cla2", "cla3", "mlkv-2", "mlkv-1"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_share_one_shape(name):
    cfg = load_config(name).model
    mha = load_config("mha").model
    assert cfg.name == name
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size) == (mha.d_model, mha.n_layers, mha.vocab_size)
    assert cfg.attention.n_heads == mha.attention.n_heads


def test_base_inheritance_and_overrides():
    swa = load_config("swa")  # swa -> gqa -> mha
    assert swa.model.attention.n_kv_heads == 2 and swa.model.attention.window == 64
    assert swa.model.attention.rope_theta == 10000.0
    over = load_config("swa", ["model.attention.window=8", "decoding.top_p=0.9", "model.norm_eps=1e-6"])
    assert over.model.attention.window == 8
    assert over.decoding.top_p == 0.9
    assert over.model.norm_eps == 1e-6  # YAML reads "1e-6" as a string; float fields accept it


def test_yaml_file_in_any_directory(tmp_path):
    (tmp_path / "parent.yaml").write_text("model:\n  d_model: 64\n  attention: {n_heads: 4, n_kv_heads: 4}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nmodel:\n  attention: {n_kv_heads: 1}\n")
    cfg = load_config(tmp_path / "child.yaml").model
    assert (cfg.name, cfg.d_model, cfg.attention.n_heads, cfg.attention.n_kv_heads) == ("child", 64, 4, 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.attention.n_kv_heads=3"], "model.attention.n_kv_heads=3 must divide model.attention.n_heads=8"),
        (["model.attention.head_dim=15"], "model.attention.head_dim=15 must be a positive even number"),
        (["model.attention.window=0"], "model.attention.window=0 must be > 0"),
        (["model.dtype=float16"], "model.dtype='float16' must be one of ('float32', 'bfloat16')"),
        (["model.d_model=0"], "model.d_model=0 must be > 0"),
        (["model.atention.n_heads=4"], "unknown config key 'model.atention'; did you mean 'attention'?"),
        (["model.attention.n_kv_head=4"], "unknown config key 'model.attention.n_kv_head'; did you mean 'n_kv_heads'?"),
        (["model.n_layers=two"], "model.n_layers='two' must be of type int"),
        (["model.n_layers=true"], "model.n_layers=True must be of type int"),
        (["model.attention.softcap=0"], "model.attention.softcap=0.0 must be > 0, or null"),
        (
            ["model.attention.softcap=50", "model.attention.impl=pallas"],
            "model.attention.impl='pallas' decodes with kvjax's Pallas kernels, which have no logit soft-capping",
        ),
        (
            ["model.attention.softcap=50", "model.layer_pattern=[retnet]"],
            "model.attention.softcap=50.0 applies to softmax attention layers only",
        ),
        (["decoding.top_p=0"], "decoding.top_p=0.0 must be in (0, 1]"),
        (["decoding.temperature=-1"], "decoding.temperature=-1.0 must be >= 0"),
        (["decoding.eos_id=264"], "decoding.eos_id=264 must be < model.vocab_size=264"),
        (["model.attention=4"], "model.attention=4 must be a mapping of AttentionConfig fields"),
        (["model.attention"], "override 'model.attention' must look like key.sub=value"),
        (["model.name.x=1"], "override 'model.name.x=1': 'model.name' is not a section"),
        (["model.kv_sharing.kind=yoco"], "model.kv_sharing.kind='yoco' must be one of ('none', 'cla', 'mlkv'"),
        (["model.kv_sharing.kind=cla"], "model.kv_sharing.factor=None must be set for kind='cla'"),
        (["model.kv_sharing.kind=cla", "model.kv_sharing.factor=0"], "model.kv_sharing.factor=0 must be > 0"),
        (
            ["model.kv_sharing.kind=cla", "model.kv_sharing.factor=2", "model.kv_sharing.n_kv_layers=2"],
            "model.kv_sharing.n_kv_layers=2 is not used by kind='cla'; remove it",
        ),
        (
            ["model.kv_sharing.kind=mlkv", "model.kv_sharing.n_kv_layers=5"],
            "model.kv_sharing.n_kv_layers=5 must be <= model.n_layers=4",
        ),
        (
            ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[1,1,2,3]"],
            "model.kv_sharing.kv_source[0]=1 must be in [0, 0] (sources point back)",
        ),
        (
            ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,0,3,3]"],
            "model.kv_sharing.kv_source[2]=3 must be in [0, 2] (sources point back)",
        ),
        (
            ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,0,1,1]"],
            "model.kv_sharing.kv_source[2]=1 names layer 1, which is not a producer (its kv_source is 0)",
        ),
        (
            ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=[0,0]"],
            "model.kv_sharing.kv_source=[0, 0] must have one entry per layer (model.n_layers=4)",
        ),
        (
            ["model.kv_sharing.kind=explicit", "model.kv_sharing.kv_source=0"],
            "model.kv_sharing.kv_source=0 must be a list",
        ),
    ],
)
def test_validation_errors_name_field_value_and_rule(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("gqa", overrides)
    assert message in str(info.value)


def test_dataclasses_validate_on_direct_construction():
    with pytest.raises(ConfigError, match="n_kv_heads=3 must divide"):
        AttentionConfig(n_heads=8, n_kv_heads=3)
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        DecodingConfig(max_new_tokens=0)
    cfg = Config()
    with pytest.raises(ConfigError, match="window=-2"):
        dataclasses.replace(cfg.model, attention=dataclasses.replace(cfg.model.attention, window=-2))
    assert isinstance(cfg.model, ModelConfig)


def test_unknown_file_and_bad_inheritance(tmp_path):
    with pytest.raises(ConfigError, match="neither a file nor a shipped model config"):
        load_config("no-such-variant")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="base='missing.yaml' does not exist"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "d.yaml")


def test_overrides_do_not_mutate_the_tree():
    tree = {"model": {"attention": {"n_heads": 8}}}
    out = apply_overrides(tree, ["model.attention.n_heads=4"])
    assert tree["model"]["attention"]["n_heads"] == 8 and out["model"]["attention"]["n_heads"] == 4


def test_a_model_config_holds_the_sections_of_its_own_kinds_only():
    """Each kind's section is filled with its defaults when a layer of that kind is present and is null
    otherwise; a setting for a kind the model lacks is refused by name, and a run directory's config
    written with every section at its defaults (as kvjax wrote them before) still loads."""
    from kvjax.kinds import KINDS

    sections = {kind.section: kind.Config for kind in KINDS.values() if kind.section}
    assert set(sections) == {"local", "mla", "mamba", "rwkv", "retnet"}
    for name, kept in [("gqa", set()), ("mla", {"mla"}), ("mamba", {"mamba"}), ("rwkv7", {"rwkv"})]:
        model = load_config(name).model
        assert {s for s in sections if getattr(model, s) is not None} == kept, name
    assert load_config("gqa", ["model.layer_pattern=[local, attention]"]).model.local == sections["local"]()
    with pytest.raises(ConfigError) as info:
        load_config("gqa", ["model.mamba.d_state=8"])
    assert str(info.value).startswith("model.mamba={'d_state': 8} configures 'mamba' layers, and this model has none")
    assert load_config("mla", ["model.layer_pattern=[attention]", "model.mla=null"]).model.mla is None
    with pytest.raises(ConfigError, match="drop the section"):  # mla.yaml's own section, no mla layer left
        load_config("mla", ["model.layer_pattern=[attention]", "model.mla.kv_lora_rank=16"])
    tree = Config().to_dict()
    tree["model"].update({section: dataclasses.asdict(cls()) for section, cls in sections.items()})
    assert from_dict(Config, tree) == Config()

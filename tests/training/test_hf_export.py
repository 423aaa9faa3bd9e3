"""Models that no Hugging Face family kvjax writes can express are refused before anything is written
(a sliding window alone is Mistral's; with q/k norms, Qwen3 has none)."""

import pytest

from kvjax.config import ConfigError
from kvjax.training.hf_export import hf_state_dict

GEMMA_BLOCK = (
    "model.n_layers=2",
    "model.local.rope_theta=100",
    "model.attention.qk_norm=true",
    "model.norm_offset=1.0",
    "model.sandwich_norms=true",
    "model.mlp_act=gelu_tanh",
    "model.embed_scale=true",
)


@pytest.mark.parametrize(
    "name, extra, message",
    [
        ("swa", "model.attention.qk_norm=true", "Qwen3ForCausalLM has no sliding window"),
        ("swa", "model.attention.qkv_bias=true", "MistralForCausalLM .a sliding window. has no attention biases"),
        ("cla2", "model.n_layers=2", "has no cross-layer K/V sharing"),
        ("mla", "model.n_layers=2", "has only attention layers"),
        ("rwkv7", "model.n_layers=2", "has only attention layers"),
        ("yoco-gret", "model.n_layers=2", "has only attention layers"),
        (  # Gemma's query_pre_attn_scalar is an int in transformers' config
            "gqa",
            ("model.layer_pattern=[local, attention]", *GEMMA_BLOCK, "model.attention.query_scale=12.5"),
            "model.attention.query_scale=12.5: Gemma3ForCausalLM needs a whole number",
        ),
        (
            "gqa",
            ("model.layer_pattern=[local, attention]", *GEMMA_BLOCK, "model.attention.qk_norm=false"),
            "model.local.rope_theta=100.0: Gemma2ForCausalLM needs 10000.0",
        ),
    ],
)
def test_export_refuses_what_no_family_can_express(make_model, name, extra, message):
    _, model = make_model(name, *((extra,) if isinstance(extra, str) else extra))
    with pytest.raises(ConfigError, match=message):
        hf_state_dict(model)


def test_export_names_every_parameter(make_model):
    cfg, model = make_model("gqa", "model.n_layers=2")
    state = hf_state_dict(model)
    assert len(state) == 2 + cfg.n_layers * 9  # embed, final norm; per layer 2 norms, q k v o, 3 MLP
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, cfg.d_model)

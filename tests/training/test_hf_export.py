"""Models that no Hugging Face family kvjax writes can express are refused before anything is written
(a sliding window alone is Mistral's; with q/k norms, Qwen3 has none)."""

import pytest

from kvjax.config import ConfigError
from kvjax.training.hf_export import hf_state_dict


@pytest.mark.parametrize(
    "name, extra, message",
    [
        ("swa", "model.attention.qk_norm=true", "Qwen3ForCausalLM has no sliding window"),
        ("swa", "model.attention.qkv_bias=true", "MistralForCausalLM .a sliding window. has no attention biases"),
        ("cla2", "model.n_layers=2", "has no cross-layer K/V sharing"),
        ("mla", "model.n_layers=2", "has only attention layers"),
        ("rwkv7", "model.n_layers=2", "has only attention layers"),
        ("yoco-gret", "model.n_layers=2", "has only attention layers"),
    ],
)
def test_export_refuses_what_no_family_can_express(make_model, name, extra, message):
    _, model = make_model(name, extra)
    with pytest.raises(ConfigError, match=message):
        hf_state_dict(model)


def test_export_names_every_parameter(make_model):
    cfg, model = make_model("gqa", "model.n_layers=2")
    state = hf_state_dict(model)
    assert len(state) == 2 + cfg.n_layers * 9  # embed, final norm; per layer 2 norms, q k v o, 3 MLP
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, cfg.d_model)

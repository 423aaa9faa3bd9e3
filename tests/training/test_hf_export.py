"""Models that LlamaForCausalLM cannot express are refused before anything is written."""

import pytest

from kvjax.config import ConfigError
from kvjax.training.hf_export import hf_state_dict


@pytest.mark.parametrize(
    "name, message",
    [
        ("swa", "has no sliding window"),
        ("cla2", "has no cross-layer K/V sharing"),
        ("mla", "has only attention layers"),
        ("rwkv7", "has only attention layers"),
        ("yoco-gret", "has only attention layers"),
    ],
)
def test_export_refuses_what_llama_cannot_express(make_model, name, message):
    _, model = make_model(name, "model.n_layers=2")
    with pytest.raises(ConfigError, match=message):
        hf_state_dict(model)


def test_export_names_every_parameter(make_model):
    cfg, model = make_model("gqa", "model.n_layers=2")
    state = hf_state_dict(model)
    assert len(state) == 2 + cfg.n_layers * 9  # embed, final norm; per layer 2 norms, q k v o, 3 MLP
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, cfg.d_model)

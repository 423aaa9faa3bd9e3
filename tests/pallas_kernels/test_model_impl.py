"""A one-layer model with `model.attention.impl=pallas` (interpret mode here) computes what the XLA path computes:
full forward, cached prefill + decode through `kvjax.Generator`, and a training step's loss and
gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax.ops
from kvjax import DecodingConfig, Generator, parse_policy
from kvjax.ops import kernel_impl
from kvjax.pallas_kernels.backend import default_backend

PROMPTS = [[5, 17, 3, 9, 11], list(range(40, 51))]


def _pair(make_model, name, *overrides):
    """The same weights under impl=xla and impl=pallas."""
    cfg, xla = make_model(name, "model.n_layers=1", *overrides)
    _, pallas = make_model(name, "model.n_layers=1", "model.attention.impl=pallas", *overrides)
    nnx.update(pallas, nnx.state(xla))
    return cfg, xla, pallas


@pytest.mark.parametrize("name, overrides", [("gqa", ("model.attention.window=6",)), ("mla", ())])
def test_forward_and_generation_match_xla(make_model, name, overrides):
    cfg, xla, pallas = _pair(make_model, name, *overrides)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    np.testing.assert_allclose(pallas(tokens, positions)[0], xla(tokens, positions)[0], atol=1e-4)
    assert "pallas_call" in str(jax.make_jaxpr(lambda t, p: pallas(t, p))(tokens, positions))  # the kernel ran
    greedy = DecodingConfig(max_new_tokens=6)
    want = Generator(xla, capacity=32)(PROMPTS, greedy)
    got = Generator(pallas, capacity=32)(PROMPTS, greedy)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


@pytest.mark.parametrize("policy", ["int:8", "kivi:2:group=4,residual=8"])
def test_a_quantized_cache_decodes_the_same_through_the_fused_kernel(make_model, monkeypatch, policy):
    """Generation over an int:8 / KIVI cache under impl=pallas goes through the fused dequantize-attend
    kernel (its decode steps call it) and gives the XLA path's tokens."""
    if policy.startswith("kivi") and default_backend() == "triton":
        pytest.skip("head_dim 16 at 2 bits is a 4-byte code plane, under Triton's smallest dot")
    _, xla, pallas = _pair(make_model, "gqa")
    calls = []
    fused = kvjax.ops.quant_decode_partials
    monkeypatch.setattr(kvjax.ops, "quant_decode_partials", lambda *a, **kw: calls.append(kw) or fused(*a, **kw))
    greedy = DecodingConfig(max_new_tokens=6)
    want = Generator(xla, capacity=32, policy=parse_policy(policy))(PROMPTS, greedy)
    got = Generator(pallas, capacity=32, policy=parse_policy(policy))(PROMPTS, greedy)
    assert calls and calls[0]["bits"] == int(policy.split(":")[1])
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_a_training_step_has_the_same_loss_and_gradients(make_model):
    from kvjax.training.trainer import token_losses

    cfg, xla, pallas = _pair(make_model, "gqa")
    windows = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 17)))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        return jax.value_and_grad(lambda p: token_losses(graphdef, p, windows).mean())(params)

    (loss_x, grads_x), (loss_p, grads_p) = loss_and_grads(xla), loss_and_grads(pallas)
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_impl_choices_and_refusals():
    assert kernel_impl("xla") == "xla" and kernel_impl("pallas") == "pallas"
    assert kernel_impl("auto") == ("pallas" if jax.default_backend() in ("tpu", "gpu") else "xla")
    assert kernel_impl("auto", pooled=True) == "xla"
    with pytest.raises(ValueError, match="no kernel for a pooled"):
        kernel_impl("pallas", pooled=True)
    with pytest.raises(ValueError, match="must be one of"):
        kernel_impl("cuda")

"""The attention implementations of `kvjax.impls`: which one runs for each platform and call, and each
equal to the XLA reference where it runs here (cuDNN's mapping through jax's XLA implementation of the
same call, splash interpreted), in a model and in training; splash lowered for TPU from this host."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.impls import PLATFORM_IMPLS, Chunk, choose
from kvjax.ops import attention

BF16 = Chunk(256, "bfloat16", 64, 64)
F32 = Chunk(256, "float32", 64, 64)


@pytest.mark.parametrize(
    "impl, platform, kwargs, want",
    [
        ("auto", "cpu", dict(chunk=BF16), "xla"),
        ("auto", "gpu", dict(chunk=BF16), "cudnn"),
        ("auto", "cuda", dict(chunk=BF16), "cudnn"),
        ("auto", "gpu", dict(chunk=F32), "pallas"),  # cuDNN computes in half precision only
        ("auto", "gpu", dict(chunk=Chunk(256, "bfloat16", 512, 512)), "pallas"),  # heads wider than cuDNN's
        ("auto", "gpu", dict(), "pallas"),  # a decode step: kvjax's kernels
        ("auto", "gpu", dict(chunk=BF16, softcap=50.0), "xla"),  # no kernel caps logits but splash
        ("auto", "gpu", dict(pooled=True), "xla"),
        ("auto", "tpu", dict(chunk=F32), "splash"),
        ("auto", "tpu", dict(chunk=Chunk(200, "float32", 64, 64)), "pallas"),  # not a whole number of blocks
        ("auto", "tpu", dict(chunk=BF16, softcap=50.0), "splash"),
        ("auto", "tpu", dict(softcap=50.0), "xla"),
        ("cudnn", "gpu", dict(chunk=BF16), "cudnn"),
        ("cudnn", "gpu", dict(), "pallas"),
        ("cudnn", "cpu", dict(chunk=BF16), "cudnn"),  # off its platform: the same call through XLA
        ("splash", "cpu", dict(chunk=F32), "splash"),  # interpreted
        ("pallas", "gpu", dict(chunk=BF16), "pallas"),
        ("xla", "tpu", dict(chunk=BF16), "xla"),
    ],
)
def test_each_platform_gets_its_best_implementation(impl, platform, kwargs, want):
    assert choose(impl, platform, **kwargs) == want


def test_calls_no_kernel_takes_are_refused_by_name():
    with pytest.raises(ValueError, match="impl='cudnn' has no kernel for a pooled"):
        choose("cudnn", "gpu", pooled=True)
    with pytest.raises(ValueError, match="impl='splash' has no kernel with soft-capped logits"):
        choose("splash", "tpu", softcap=30.0)  # splash caps a prefill's logits; decode runs Pallas, which cannot
    with pytest.raises(ValueError, match="must be one of"):
        choose("flash", "gpu")


def _case(T=256, N=4, K=2, H=64, lengths=(256, 177), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, K, T, H)), dtype) for _ in range(2))
    pos = jnp.asarray(np.where(np.arange(T)[None] < np.array(lengths)[:, None], np.arange(T)[None], -1), jnp.int32)
    return q, k, v, pos


@pytest.mark.parametrize("name", sorted(PLATFORM_IMPLS))
@pytest.mark.parametrize("window, softcap", [(None, None), (48, None), (None, 20.0)])
def test_each_platform_kernel_equals_the_xla_reference(name, window, softcap):
    """Causal, a sliding window and soft-capped logits over right-padded rows of a GQA chunk: the
    platform kernel's output equals `kvjax.ops.attention`'s XLA path on every query (zeros for padding)."""
    if name == "cudnn" and softcap is not None:
        pytest.skip("cuDNN has no soft-capped logits (refused by supports)")
    q, k, v, pos = _case()
    want = attention(q, k, v, pos, pos, window=window, softcap=softcap, impl="xla")
    got = PLATFORM_IMPLS[name].attention(q, k, v, pos, pos, window=window, scale=None, softcap=softcap)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.all(np.asarray(got)[1, 177:] == 0)


@pytest.mark.parametrize("impl, dtype, tol", [("splash", "float32", 1e-4), ("cudnn", "bfloat16", 5e-2)])
def test_a_model_under_a_platform_impl_prefills_decodes_and_trains_as_xla(make_model, monkeypatch, impl, dtype, tol):
    """A 2-layer model with `model.attention.impl=cudnn|splash`: its prefill chunks go through the
    platform kernel (the rest through kvjax's Pallas kernels), with the XLA path's logits, greedy tokens
    and training gradients (cuDNN in bfloat16, the only precision it computes in)."""
    from kvjax import DecodingConfig, Generator
    from kvjax.training.trainer import token_losses

    common = ("model.n_layers=2", "model.attention.window=100", f"model.dtype={dtype}")  # layer 0 prefills all
    cfg, xla = make_model("gqa", *common)
    _, other = make_model("gqa", *common, f"model.attention.impl={impl}")
    nnx.update(other, nnx.state(xla))
    kernel, calls = PLATFORM_IMPLS[impl], []
    run = kernel.attention
    monkeypatch.setattr(kernel, "attention", lambda *a, **kw: calls.append(a[0].shape) or run(*a, **kw))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 256)))
    positions = jnp.broadcast_to(jnp.arange(256), (2, 256))
    close = dict(atol=tol, rtol=tol)
    np.testing.assert_allclose(*(np.asarray(m(tokens, positions)[0], np.float32) for m in (other, xla)), **close)
    prompts = [list(range(3, 131)), list(range(40, 168))]  # one 128-token bucket: splash's block
    greedy = DecodingConfig(max_new_tokens=4)
    want, got = (Generator(m, capacity=160)(prompts, greedy) for m in (xla, other))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, **close)
    assert (2, 256, 8, 16) in calls and (2, 128, 8, 16) in calls  # the forward's and the prefill's chunk

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        return jax.value_and_grad(lambda p: token_losses(graphdef, p, tokens[:, :129]).mean())(params)

    (loss_x, grads_x), (loss_o, grads_o) = loss_and_grads(xla), loss_and_grads(other)
    np.testing.assert_allclose(loss_o, loss_x, **close)
    for a, b in zip(jax.tree.leaves(grads_o), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol / 10)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_splash_lowers_for_tpu_from_this_host(dtype):
    from kvjax.impls import splash

    def prefill(q, k, v, pos):
        return splash.attention(q, k, v, pos, pos, window=64, interpret=False)

    specs = [((2, 256, 9, 64), dtype), ((2, 3, 256, 64), dtype), ((2, 3, 256, 64), dtype), ((2, 256), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
    text = jax.jit(prefill).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "splash" in text.lower()

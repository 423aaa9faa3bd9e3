"""The decoder oracles of DESIGN.md as helpers every mixer's tests call: cached decode == full forward,
gradient causality; plus the tiny batch they run on."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.plan import init_caches

B, T = 2, 24


def tokens_and_positions(vocab, seed=0, length=T):
    tokens = jax.random.randint(jax.random.key(seed), (B, length), 0, vocab)
    return tokens, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (B, length))


def stepper(model, jit):
    """A function (tokens, positions, caches) -> (logits, caches), jitted through split/merge or eager."""
    if not jit:
        return model
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a)).__get__(state)


def assert_cached_decode_equals_full_forward(
    cfg, model, *, prefill: int = 10, jit: bool = True, length: int = T, capacity: int | None = None
):
    """Prefill `prefill` of `length` tokens, then decode one at a time into caches of `capacity` slots
    (default: length): logits match the full forward everywhere. Returns the final caches."""
    tokens, pos = tokens_and_positions(cfg.vocab_size, length=length)
    full, _ = stepper(model, jit=True)(tokens, pos)
    step = stepper(model, jit)
    logits, caches = step(tokens[:, :prefill], pos[:, :prefill], init_caches(cfg, B, capacity or length))
    np.testing.assert_allclose(logits, full[:, :prefill], atol=2e-5, rtol=1e-5)
    for t in range(prefill, length):
        logits, caches = step(tokens[:, t : t + 1], pos[:, t : t + 1], caches)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=1e-5, err_msg=f"position {t}")
    return caches


def assert_gradient_causal(cfg, model, t: int = 11):
    """d loss(t) / d input(s) is exactly zero for every s > t, and not zero for s <= t."""
    tokens, pos = tokens_and_positions(cfg.vocab_size)

    def loss_at_t(x):
        hidden, _ = model.run_blocks(x, pos)
        return jax.nn.log_softmax(model.logits(hidden[:, t]))[:, 0].sum()

    grad = np.asarray(jax.grad(loss_at_t)(model.embed(tokens)))
    assert np.all(grad[:, t + 1 :] == 0)
    assert np.all(np.abs(grad[:, : t + 1]).sum(axis=-1) > 0)


def assert_finite_on_long_sequence(cfg, model, length: int = 4096):
    """A recurrent model's fp32 outputs stay finite over a long sequence (no overflowing state)."""
    tokens = jax.random.randint(jax.random.key(0), (1, length), 0, cfg.vocab_size)
    logits, _ = jax.jit(lambda t, p: model(t, p))(tokens, jnp.arange(length)[None])
    assert np.isfinite(np.asarray(logits)).all()


def assert_ragged_prefill_continues_each_row(cfg, model):
    """Rows of lengths T and 13, right-padded (position -1) and prefilled in chunks of 5 up to 15: row 1
    then continues from its true end as if the padding never happened (no state or buffer saw it)."""
    tokens, pos = tokens_and_positions(cfg.vocab_size, seed=1)
    full, _ = stepper(model, jit=True)(tokens, pos)
    ragged = jnp.where(pos < jnp.array([[T], [13]]), pos, -1)
    step = stepper(model, jit=True)
    caches = init_caches(cfg, B, T)
    for start in range(0, 15, 5):
        _, caches = step(tokens[:, start : start + 5], ragged[:, start : start + 5], caches)
    for t in range(13, 16):
        logits, caches = step(tokens[:, t : t + 1], jnp.full((B, 1), t), caches)
        np.testing.assert_allclose(logits[1, 0], full[1, t], atol=2e-5, rtol=1e-5, err_msg=f"position {t}")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.sampling import sample

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


def draws(n=4000, **kw):
    keys = jax.random.split(jax.random.key(0), n)
    return np.asarray(jax.vmap(lambda k: sample(LOGITS, k, **kw)[0])(keys))


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(1), (5, 50))
    np.testing.assert_array_equal(sample(logits, jax.random.key(2)), jnp.argmax(logits, -1))


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(kw):
    logits = jax.random.normal(jax.random.key(1), (5, 50))
    np.testing.assert_array_equal(sample(logits, jax.random.key(2), **kw), jnp.argmax(logits, -1))


@pytest.mark.parametrize(
    "kw, support",
    [
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.7), [0, 1]),  # 0.5 < 0.7, then 0.8 >= 0.7: keep two
        (dict(top_p=0.85), [0, 1, 2]),
        (dict(top_p=0.8, top_k=1), [0]),
    ],
)
def test_truncation_keeps_the_right_support_with_renormalised_frequencies(kw, support):
    got = draws(temperature=1.0, **kw)
    assert set(np.unique(got)) == set(support)
    expected = PROBS[support] / PROBS[support].sum()
    freq = np.bincount(got, minlength=4)[support] / len(got)
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_top_p_stops_as_soon_as_the_mass_reaches_p():
    """The kept set is the smallest whose mass reaches p: at p = 0.5 the top token (mass 0.5) alone."""
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.125, 0.125]], jnp.float32))
    keys = jax.random.split(jax.random.key(3), 500)
    got = jax.vmap(lambda k: sample(logits, k, temperature=1.0, top_p=0.5)[0])(keys)
    assert set(np.unique(np.asarray(got))) == {0}


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draws(temperature=0.25), minlength=4) / 4000
    hot = np.bincount(draws(temperature=4.0), minlength=4) / 4000
    assert cold[0] > 0.85 and hot[0] < 0.4

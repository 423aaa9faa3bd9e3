"""D2O: attention density, layer budgets and the merge follow the reference code's definitions on raw
tensors; in generation the edge layers keep everything, the others their budgets, bytes are exact, and
bad policies are clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import Generator
from kvjax.cache import KVCache, caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy
from kvjax.compress.d2o import D2OKVCache, layer_counts, layer_sigma, merge
from kvjax.config import ConfigError
from tests.kvjax.test_compress import CAPACITY, GREEDY, NEW, PROMPTS


def test_density_is_the_mean_normalised_variance_of_column_sums():
    rng = np.random.default_rng(0)
    stat = rng.random((2, 3, 7)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, -1, -1]])
    out = np.asarray(layer_sigma(jnp.asarray(stat), jnp.asarray(pos)))
    for b in range(2):
        var = np.array([np.var(stat[b, h][pos[b] >= 0], ddof=1) for h in range(3)])
        assert out[b] == pytest.approx(np.mean((var - var.min()) / (var.max() - var.min() + 1e-6)), rel=1e-5)


def test_layer_budgets_follow_the_reference_formula():
    sigma = np.array([[0.1], [0.9], [0.3], [0.5], [0.2]])
    counts = layer_counts(sigma, np.array([99]), keep=0.2, never=1000)
    w = np.exp(-sigma[:, 0]) / np.exp(-sigma[:, 0]).sum()
    r = np.clip(w * 5 * 0.2, 0.01, 1)
    expected = [2 * int(100 * x / 2) for x in r]
    assert counts[2, 0] == expected[2] and counts[3, 0] == expected[3]
    assert counts[0, 0] == counts[1, 0] == counts[4, 0] == 1000  # the first two and the last: never compressed
    assert counts[2, 0] > counts[3, 0]  # the denser layer (lower variance) keeps more
    flat = layer_counts(np.full((5, 1), 0.4), np.array([99]), keep=0.5, never=1000)
    assert flat[2, 0] == 50  # equal densities: every layer keeps rho
    tiny = layer_counts(np.array([[0.0], [0.0], [1.0], [0.0], [0.0]]), np.array([99]), keep=0.01, never=1)
    assert tiny[2, 0] == 8  # never below the sinks twice over
    one = layer_counts(np.array([[0.5]]), np.array([99]), keep=0.5, never=1000)  # a hybrid's one attention layer
    assert one.tolist() == [[1000]]  # (it raised an IndexError until 2026-12-07)


def test_merge_follows_the_reference_rule():
    rng = np.random.default_rng(1)
    B, K, S, H = 1, 2, 6, 4
    k = rng.normal(size=(B, K, S, H)).astype(np.float32)
    v = rng.normal(size=(B, K, S, H)).astype(np.float32)
    cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.arange(S)[None], length=jnp.array([S]))
    idx = jnp.asarray([[[0, 1, 2], [0, 3, 5]]])  # kept slots per head
    valid = jnp.ones_like(idx, bool)
    out = merge(cache, idx, valid, ema=0.5)
    kept = [[0, 1, 2], [0, 3, 5]]
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    u, tgt = np.zeros((K, S)), np.zeros((K, S), int)
    for h in range(K):
        for e in range(S):
            if e not in kept[h]:
                sims = [unit[0, h, e] @ unit[0, h, c] for c in kept[h]]
                u[h, e], tgt[h, e] = max(sims), kept[h][int(np.argmax(sims))]
    evicted = np.array([[e not in kept[h] for e in range(S)] for h in range(K)])
    tau = u[evicted].mean()
    assert float(out.tau[0]) == pytest.approx(tau, rel=1e-5)
    head_mean = (u * evicted).sum(0) / np.maximum(evicted.sum(0), 1)
    ref_k, ref_v = k.copy(), v.copy()
    for h in range(K):
        for c in kept[h]:
            src = [e for e in range(S) if evicted[h, e] and tgt[h, e] == c and head_mean[e] >= tau]
            ref_k[0, h, c] = (k[0, h, c] + sum(u[h, e] * k[0, h, e] for e in src)) / (1 + len(src))
            ref_v[0, h, c] = (v[0, h, c] + sum(u[h, e] * v[0, h, e] for e in src)) / (1 + len(src))
    assert any(head_mean[e] >= tau for e in range(S)) and any(
        evicted[:, e].any() and head_mean[e] < tau for e in range(S)
    )
    np.testing.assert_allclose(out.k, ref_k, atol=1e-5)
    np.testing.assert_allclose(out.v, ref_v, atol=1e-5)
    for evicts in (3, 4):  # a decode step's bound: only each head's (3) evicted slots compared, a kept one masked
        bounded = merge(cache, idx, valid, ema=0.5, evicts=evicts)
        for got, want in ((bounded.k, out.k), (bounded.v, out.v), (bounded.tau, out.tau)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    again = merge(out, idx, valid, ema=0.25)  # the threshold's moving average: 0.25 old + 0.75 new
    unit2 = np.asarray(out.k) / np.linalg.norm(np.asarray(out.k), axis=-1, keepdims=True)
    mean_u = np.mean(
        [max(unit2[0, h, e] @ unit2[0, h, c] for c in kept[h]) for h in range(K) for e in range(S) if evicted[h, e]]
    )
    assert float(again.tau[0]) == pytest.approx(0.25 * tau + 0.75 * mean_u, rel=1e-5)


@pytest.fixture(scope="module")
def gqa5(make_model):
    return make_model("gqa", "model.n_layers=5", "model.init_std=0.2")


def test_generation_keeps_edge_layers_whole_others_at_budget_and_bytes_are_exact(gqa5):
    cfg, model = gqa5
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("d2o:0.5"))
    tokens, lengths = gen.pad(PROMPTS, NEW)
    logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    counts = gen._layer_counts[1]
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    for j, cache in enumerate(caches):
        assert isinstance(cache, D2OKVCache)
        filled = np.asarray(cache.pos >= 0).sum(-1)  # per row and head
        expected = lengths if j in (0, 1, 4) else np.minimum(counts[j], lengths)
        np.testing.assert_array_equal(filled, np.broadcast_to(expected[:, None], filled.shape))
    assert all(np.isnan(caches[j].tau).all() for j in (0, 1, 4))  # nothing evicted, nothing merged
    assert np.isfinite(caches[2].tau).all()
    out = gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    for j in (2, 3):  # evicting back to the budget at every step
        filled = np.asarray(out.caches[j].pos >= 0).sum(-1)
        assert (filled <= counts[j][:, None]).all()
    np.testing.assert_array_equal(np.asarray(out.caches[0].pos >= 0).sum(-1)[:, 0], lengths + NEW - 1)


def test_bad_d2o_policies_are_clear_errors(gqa5):
    _, model = gqa5
    with pytest.raises(ConfigError, match="cannot be chained"):
        parse_policy("streaming:0.5+d2o:0.5")
    with pytest.raises(ConfigError, match="brings its own layer budgets"):
        parse_policy("d2o:0.5:reducer=kvmerger")
    with pytest.raises(ConfigError, match="a ratio in"):
        parse_policy("d2o:64")
    with pytest.raises(ConfigError, match="unknown option 'ema'; h2o's own options"):
        parse_policy("h2o:0.5:ema=0.3")
    assert parse_policy("d2o:0.5").stages[0].every == 1  # evicts at every decode step
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("d2o:0.5"))
    with pytest.raises(ConfigError, match="prefill these prompts first"):
        gen.compression_plan(np.array([40, 29]), NEW)

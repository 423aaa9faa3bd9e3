"""ThinK: channel scores follow their definition on raw tensors, pruned channels are not stored and read
as zeros (the recent window and decoded tokens whole), ratio 0 is the base policy bitwise, bytes are
exact, and bad policies are clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import Generator
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy
from kvjax.compress.policy import Stage
from kvjax.compress.think import ThinKCache, channel_scores, kept_channels, observe
from kvjax.config import ConfigError
from tests.kvjax.test_compress import CAPACITY, GREEDY, NEW, PROMPTS


@pytest.fixture(scope="module")
def gqa(make_model):
    return make_model("gqa", "model.n_layers=2", "model.init_std=0.2")


def test_channel_scores_are_mean_squared_window_queries_times_mean_squared_keys():
    rng = np.random.default_rng(0)
    B, W, N, K, S, H = 1, 5, 4, 2, 6, 8
    q = rng.normal(size=(B, W, N, H)).astype(np.float32)
    k = rng.normal(size=(B, K, S, H)).astype(np.float32)
    obs_pos = np.array([[-1, 10, 11, 12, 13]])
    pos = np.array([[0, 1, 2, 3, -1, -1]])
    stat = observe(Stage.of("think", ratio=0.5, obs_window=3), jnp.asarray(q), jnp.asarray(obs_pos))
    scores = np.asarray(channel_scores(stat.q2, jnp.asarray(k), jnp.asarray(pos)))
    voters = q[0, 2:]  # positions 11..13, the last 3
    for h in range(K):
        q2 = (voters[:, h * 2 : h * 2 + 2] ** 2).mean(axis=(0, 1))
        k2 = (k[0, h, :4] ** 2).mean(axis=0)
        np.testing.assert_allclose(scores[0, h], q2 * k2, rtol=1e-5)
    chosen = np.asarray(kept_channels(jnp.asarray(scores), 0.4))
    assert chosen.shape == (1, K, 8 - 3)  # int(0.4 x 8) = 3 channels dropped
    for h in range(K):
        assert list(chosen[0, h]) == sorted(np.argsort(-scores[0, h], kind="stable")[:5])


@pytest.mark.parametrize("base", [None, "snapkv:0.5:obs_window=8"])
def test_ratio_zero_is_its_base_policy_bitwise(gqa, base):
    _, model = gqa
    prompt = [PROMPTS[0]]
    policy = "think:0" if base is None else f"{base}+think:0"
    ref = Generator(model, capacity=CAPACITY, policy=None if base is None else parse_policy(base))
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
    tokens, lengths = ref.pad(prompt, NEW)
    if base is None:
        logits, caches = ref.prefill(tokens, lengths)
        stats = None
    else:
        logits, caches, stats = ref.prefill_compressed(tokens, lengths, NEW)
    _, pruned, pstats = gen.prefill_compressed(tokens, lengths, NEW)
    assert all(isinstance(c, ThinKCache) for c in pruned)
    a = ref.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    b = gen.decode(pruned, logits, lengths, GREEDY, jax.random.key(0), pstats)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_pruned_channels_are_not_stored_and_read_as_zeros_except_recent_and_new_tokens(gqa):
    cfg, model = gqa
    plain = Generator(model, capacity=CAPACITY)
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("think:0.5:window=4,obs_window=8"))
    tokens, lengths = plain.pad(PROMPTS, NEW)
    logits, dense = plain.prefill(tokens, lengths)
    _, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    assert caches_nbytes(caches) < caches_nbytes(dense)
    H = cfg.attention.head_dim
    for cache, full in zip(caches, dense):
        assert cache.k.shape[-1] == H - H // 2
        keys = np.asarray(cache.keys())
        original = np.asarray(full.k)[:, :, : keys.shape[2]]
        for b, n in enumerate(lengths):
            for h in range(keys.shape[1]):
                kept = np.asarray(cache.channels[b, h])
                dropped = np.setdiff1d(np.arange(H), kept)
                np.testing.assert_array_equal(keys[b, h, :n][:, kept], original[b, h, :n][:, kept])
                np.testing.assert_array_equal(keys[b, h, : n - 4][:, dropped], 0)
                np.testing.assert_array_equal(keys[b, h, n - 4 : n], original[b, h, n - 4 : n])  # recent: whole
    out = gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    assert caches_nbytes(out.caches) == caches_nbytes(caches)
    np.testing.assert_array_equal(out.caches[0].tail.length, NEW - 1)  # decoded tokens: full keys


def test_bad_think_policies_are_clear_errors(make_model):
    with pytest.raises(ConfigError, match="a ratio in"):
        parse_policy("think:12")
    with pytest.raises(ConfigError, match="encode last"):
        parse_policy("think:0.4+snapkv:0.5")
    with pytest.raises(ConfigError, match="every=, allocator= and reducer="):
        parse_policy("think:0.4:every=2")
    _, mla = make_model("mla", "model.n_layers=2")
    with pytest.raises(ConfigError, match="MLA"):
        Generator(mla, capacity=CAPACITY, policy=parse_policy("think:0.4"))

"""MiniCache: the SLERP direction and angles follow eq. 3 on raw tensors, restoration is exact where it
must be (t = 0 for the lower layer, retained tokens, equal layers), degenerate settings are the
baseline, bytes are exact, and bad options are clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import Generator
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy
from kvjax.compress.minicache import MergedKVCache, PartnerKVCache, angle, merged_pairs, retained_slots, slerp_direction
from kvjax.config import ConfigError
from tests.kvjax.test_compress import CAPACITY, GREEDY, NEW, PROMPTS


@pytest.fixture(scope="module")
def gqa4(make_model):
    return make_model("gqa", "model.n_layers=4", "model.init_std=0.2")


def test_pairs_are_the_top_fraction_of_layers_from_the_bottom_up():
    assert merged_pairs(4, 0.5) == ((2, 3),)
    assert merged_pairs(30, 0.5) == ((15, 16), (17, 18), (19, 20), (21, 22), (23, 24), (25, 26), (27, 28))
    assert merged_pairs(6, 1 - 1e-9) == ((0, 1), (2, 3), (4, 5))
    assert merged_pairs(5, 0.6) == ((2, 3),)  # 3 layers merged: one pair and one left alone
    assert merged_pairs(8, 0.0) == ()


def test_slerp_direction_and_angle_follow_eq_3():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 8)), rng.normal(size=(5, 8))
    ua, ub = a / np.linalg.norm(a, axis=-1, keepdims=True), b / np.linalg.norm(b, axis=-1, keepdims=True)
    omega = np.arccos(np.sum(ua * ub, -1))
    np.testing.assert_allclose(angle(jnp.asarray(a), jnp.asarray(b)), omega, rtol=1e-5)
    t = 0.6
    ref = (np.sin((1 - t) * omega) / np.sin(omega))[:, None] * ua + (np.sin(t * omega) / np.sin(omega))[:, None] * ub
    out = np.asarray(slerp_direction(jnp.asarray(a), jnp.asarray(b), t))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(slerp_direction(jnp.asarray(a), jnp.asarray(b), 0.0), ua, atol=1e-5)
    np.testing.assert_allclose(slerp_direction(jnp.asarray(a), jnp.asarray(b), 1.0), ub, atol=1e-5)
    same = slerp_direction(jnp.asarray(a), jnp.asarray(3 * a), t)  # Omega = 0: the shared direction
    np.testing.assert_allclose(same, ua, atol=1e-5)


def _caches(model, policy):
    plain = Generator(model, capacity=CAPACITY)
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
    tokens, lengths = plain.pad(PROMPTS, NEW)
    logits, caches = plain.prefill(tokens, lengths)
    _, merged, stats = gen.prefill_compressed(tokens, lengths, NEW)
    return plain, gen, lengths, logits, caches, merged, stats


def test_no_merged_layer_is_bitwise_the_baseline_and_retaining_every_token_is_lossless(gqa4):
    _, model = gqa4
    for policy, exact in [("minicache:0", True), ("minicache:0.5:retain=1", False)]:
        plain, gen, lengths, logits, caches, merged, stats = _caches(model, policy)
        ref = plain.decode(caches, logits, lengths, GREEDY, jax.random.key(0))
        out = gen.decode(merged, logits, lengths, GREEDY, jax.random.key(0), stats)
        np.testing.assert_array_equal(ref.tokens, out.tokens)
        if exact:
            np.testing.assert_array_equal(ref.logprobs, out.logprobs)
        else:  # the same keys, values and positions in another slot layout
            assert isinstance(out.caches[2], MergedKVCache) and isinstance(out.caches[3], PartnerKVCache)
            np.testing.assert_allclose(ref.logprobs, out.logprobs, atol=1e-5)


def test_merged_pair_restores_magnitudes_keeps_retained_originals_and_bytes_are_exact(gqa4):
    cfg, model = gqa4
    _, gen, lengths, _, caches, merged, _ = _caches(model, "minicache:0.5:t=0,retain=0.1")
    assert caches_nbytes(merged) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    assert caches_nbytes(merged) < caches_nbytes(caches)
    lower, upper, pair = caches[2], caches[3], merged[2]
    T = pair.pos.shape[1]
    assert T == 40 and pair.kept.shape[-1] == 4  # ceil(0.1 x 40) retained per head
    filled = np.asarray(pair.pos >= 0)[:, None, :, None]
    k0, v0 = pair.restored(0)
    np.testing.assert_allclose(np.where(filled, k0, 0), np.where(filled, lower.k[:, :, :T], 0), atol=1e-5)  # t = 0
    np.testing.assert_allclose(np.where(filled, v0, 0), np.where(filled, lower.v[:, :, :T], 0), atol=1e-5)
    k1, _ = pair.restored(1)
    norms = np.linalg.norm(np.asarray(k1), axis=-1)
    np.testing.assert_allclose(
        np.where(filled[..., 0], norms, 0),
        np.where(filled[..., 0], np.linalg.norm(upper.k[:, :, :T], axis=-1), 0),
        rtol=1e-5,
    )
    kept = np.asarray(pair.kept)
    rows, heads = np.arange(2)[:, None, None], np.arange(kept.shape[1])[None, :, None]
    np.testing.assert_array_equal(np.asarray(k1)[rows, heads, kept], np.asarray(upper.k)[rows, heads, kept])
    d = np.asarray(angle(lower.k[:, :, :T], upper.k[:, :, :T]))
    d = np.where(np.asarray(pair.pos)[:, None, :] >= 0, d, -1)
    for b in range(2):
        for h in range(kept.shape[1]):
            assert set(kept[b, h]) == set(np.argsort(-d[b, h], kind="stable")[:4])
    assert np.array_equal(np.asarray(retained_slots(lower.k[:, :, :T], upper.k[:, :, :T], pair.pos, 4)), kept)


def test_bad_minicache_policies_are_clear_errors(make_model):
    with pytest.raises(ConfigError, match="fraction of layers merged"):
        parse_policy("minicache:12")
    with pytest.raises(ConfigError, match="t=1.5 and retain"):
        parse_policy("minicache:0.5:t=1.5")
    with pytest.raises(ConfigError, match="unknown option 'retain'"):
        parse_policy("snapkv:0.5:retain=0.2")
    with pytest.raises(ConfigError, match="cannot be chained"):
        parse_policy("minicache:0.5+int:8")
    _, mla = make_model("mla", "model.n_layers=2")
    with pytest.raises(ConfigError, match="MLA"):
        Generator(mla, capacity=CAPACITY, policy=parse_policy("minicache:0.5"))

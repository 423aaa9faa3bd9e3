"""KV quantization: packing round-trips, error bounds, KIVI's block-wise residual, exact bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import DecodingConfig, Generator, parse_policy
from kvjax.cache import caches_nbytes
from kvjax.compress import compressed_cache_bytes
from kvjax.config import ConfigError
from kvjax.quant import QuantKVCache, QuantSpec
from kvjax.quant.lowrank import lorc_bases, progressive_keep
from kvjax.quant.packing import pack, unpack
from kvjax.quant.parts import low_rank
from kvjax.quant.quantizers import dequantize, quantize
from tests.kvjax.test_compress import CAPACITY, NEW, PROMPTS, _assert_same_decoding, _plain_and_compressed


@pytest.fixture(scope="module")
def gqa(make_model):
    return make_model("gqa", "model.n_layers=2", "model.init_std=0.2")


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 4), width=st.integers(1, 6), seed=st.integers(0, 99))
def test_packing_round_trips_and_uses_bits_per_code(bits, rows, width, seed):
    n = width * 8
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, n)).astype(np.uint8)
    packed = jax.jit(pack, static_argnums=1)(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (rows, n * bits // 8)
    np.testing.assert_array_equal(jax.jit(unpack, static_argnums=1)(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bit_plane_j_holds_a_contiguous_run_of_codes(bits):
    """Plane-major packing (what the fused kernel reads): (byte >> j * bits) & mask over a vector's W
    bytes is codes [j W, (j + 1) W)."""
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 64)).astype(np.uint8)
    packed = np.asarray(pack(jnp.asarray(codes), bits)).astype(np.int32)
    W = packed.shape[-1]
    for j in range(8 // bits):
        np.testing.assert_array_equal((packed >> (j * bits)) & (2**bits - 1), codes[:, j * W : (j + 1) * W])


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([1, 4, 16]),
    scale=st.floats(1e-3, 1e3),
    symmetric=st.booleans(),
    seed=st.integers(0, 999),
)
def test_round_trip_error_is_within_the_bit_width_bound(bits, group, scale, symmetric, seed):
    x = np.random.default_rng(seed).normal(size=(3, 32)).astype(np.float32) * scale
    codes, s, z = quantize(jnp.asarray(x), bits, group, symmetric=symmetric)
    assert int(codes.max()) < 2**bits
    back = np.asarray(dequantize(codes, s, z, bits, group))
    g = x.reshape(3, -1, group)
    if symmetric:
        bound = np.abs(g).max(-1) / (2 * (2 ** (bits - 1) - 1))
    else:
        bound = (g.max(-1) - g.min(-1)) / (2 * (2**bits - 1))
    err = np.abs(back - x).reshape(3, -1, group).max(-1)
    assert (err <= bound * (1 + 1e-5) + 1e-6 * scale).all()


def _tokens(seed, B=2, T=37, K=2, H=8, lengths=(37, 23)):
    r = np.random.default_rng(seed)
    k = jnp.asarray(r.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, T, K, H)), jnp.float32)
    pos = np.where(np.arange(T)[None] < np.array(lengths)[:, None], np.arange(T)[None], -1)
    return k, v, jnp.asarray(pos, jnp.int32)


# Jitted: one compile per chunk shape instead of one per eager op (hypothesis varies the shapes).
_update = jax.jit(lambda cache, k, v, pos: cache.update(k, v, pos))


def _feed(cache, k, v, pos, cuts):
    for a, b in zip([0, *cuts], [*cuts, k.shape[1]]):
        cache, view = _update(cache, k[:, a:b], v[:, a:b], pos[:, a:b])
    return cache, view


@settings(max_examples=5, deadline=None)  # every example compiles new chunk shapes
@given(cuts=st.lists(st.integers(1, 36), min_size=1, max_size=3, unique=True).map(sorted), bits=st.sampled_from([2, 4]))
def test_kivi_does_not_depend_on_how_tokens_arrive(cuts, bits):
    """Blocks align to absolute token indices, so chunked prefill + decode == one write of everything."""
    spec = QuantSpec("kivi", bits, group=4, residual=8)
    k, v, pos = _tokens(0)
    empty = QuantKVCache.init(spec, 2, 48, 2, 8, jnp.float32)
    one, view_one = _update(empty, k, v, pos)
    many, view_many = _feed(empty, k, v, pos, cuts)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(view_one.k, view_many.k)


def test_kivi_keeps_a_full_precision_residual_and_never_requantizes_history():
    spec = QuantSpec("kivi", 2, group=4, residual=8)
    k, v, pos = _tokens(1)
    cache, view = _update(QuantKVCache.init(spec, 2, 48, 2, 8, jnp.float32), k, v, pos)
    np.testing.assert_array_equal(cache.n_quant, [32, 16])  # whole blocks of 8 leave the residual
    for b, n in enumerate([37, 23]):
        q = int(cache.n_quant[b])
        np.testing.assert_array_equal(np.asarray(view.k)[b, :, q:n], np.asarray(k)[b, q:n].transpose(1, 0, 2))
        np.testing.assert_array_equal(np.asarray(view.v)[b, :, q:n], np.asarray(v)[b, q:n].transpose(1, 0, 2))
        # quantized keys: per channel, per group of 4 tokens, within the 2-bit min-max bound
        kb = np.asarray(k)[b, :q].transpose(1, 0, 2).reshape(2, q // 4, 4, 8)
        bound = (kb.max(2) - kb.min(2)) / (2 * 3)
        err = np.abs(np.asarray(view.k)[b, :, :q].reshape(2, q // 4, 4, 8) - kb).max(2)
        assert (err <= bound + 1e-5).all()
    before = np.asarray(cache.k_codes).copy(), np.asarray(cache.k_scale).copy()
    r = np.random.default_rng(2)
    for step in range(12):  # decode: row 0 crosses another block boundary at 40
        new = jnp.asarray(r.normal(size=(2, 1, 2, 8)), jnp.float32)
        cache, _ = _update(cache, new, new, jnp.asarray([[37 + step], [23 + step]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.k_codes)[0, :, :32], before[0][0, :, :32])
    np.testing.assert_array_equal(np.asarray(cache.k_scale)[0, :, :8], before[1][0, :, :8])
    np.testing.assert_array_equal(cache.n_quant, [48, 32])


def test_int_quantization_is_per_token_symmetric():
    k, v, pos = _tokens(3)
    cache, view = QuantKVCache.init(QuantSpec("int", 8), 2, 40, 2, 8, jnp.float32).update(k, v, pos)
    x = np.asarray(k)[0].transpose(1, 0, 2)  # [K,T,H]
    bound = np.abs(x).max(-1, keepdims=True) / (2 * 127)
    assert (np.abs(np.asarray(view.k)[0, :, :37] - x) <= bound + 1e-6).all()
    assert cache.k_codes.shape == (2, 2, 40, 8) and cache.k_scale.shape == (2, 2, 40, 1)
    four, _ = QuantKVCache.init(QuantSpec("int", 4), 2, 40, 2, 8, jnp.float32).update(k, v, pos)
    assert four.k_codes.shape == (2, 2, 40, 4)  # two 4-bit codes per byte


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_asymmetric_int_quantization_is_per_token_min_max(bits):
    k, v, pos = _tokens(4)
    cache, view = QuantKVCache.init(QuantSpec("int", bits, asym=True), 2, 40, 2, 8, jnp.float32).update(k, v, pos)
    for got, x in ((view.k, k), (view.v, v)):
        x = np.asarray(x)[0].transpose(1, 0, 2)  # [K,T,H]
        bound = (x.max(-1, keepdims=True) - x.min(-1, keepdims=True)) / (2 * (2**bits - 1))
        assert (np.abs(np.asarray(got)[0, :, :37] - x) <= bound + 1e-5).all()
    assert cache.k_zero.shape == cache.k_scale.shape == (2, 2, 40, 1)
    assert cache.k_codes.shape == (2, 2, 40, 8 * bits // 8)
    assert parse_policy("int:2:asym").stages[0].quant_spec.asym and str(parse_policy("int:2:asym")) == "int:2:asym=true"
    assert parse_policy(str(parse_policy("int:2:asym"))) == parse_policy("int:2:asym")


def test_kivi_with_a_residual_covering_the_sequence_is_no_quantization(gqa):
    """Quantization switched off (every token in the residual): decoding is bitwise the plain cache's."""
    plain, gen, lengths, (logits, caches), (_, caches_c, stats) = _plain_and_compressed(
        gqa[1], "kivi:4:group=2,residual=64"
    )
    for a, b in zip(caches, caches_c):
        k, v = b.dequantized()
        np.testing.assert_array_equal(k[:, :, :40], a.k[:, :, :40])
        np.testing.assert_array_equal(v[:, :, :40], a.v[:, :, :40])
    _assert_same_decoding(plain, gen, lengths, caches, caches_c, logits, stats)


@pytest.mark.parametrize(
    "policy",
    [
        "int:4",
        "int:2:asym",
        "kivi:2:group=4,residual=8",
        "snapkv:0.5:obs_window=8+kivi:4:group=4,residual=8",
        "kvquant:2:group=8,residual=8,outliers=0.1,sinks=2",
        "snapkv:0.5:obs_window=8+gear:2:group=8,residual=16,rank=3,outliers=0.2",
    ],
)
def test_measured_bytes_equal_analytic_and_decoding_runs(gqa, policy):
    cfg, model = gqa
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
    tokens, lengths = gen.pad(PROMPTS, NEW)
    logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    plans = gen.compression_plan(lengths, NEW)
    assert all(isinstance(c, QuantKVCache) for c in caches)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, plans, 2, CAPACITY)
    out = gen.decode(caches, logits, lengths, DecodingConfig(max_new_tokens=NEW), jax.random.key(0))
    assert caches_nbytes(out.caches) == caches_nbytes(caches) and np.isfinite(out.logprobs).all()
    if policy.startswith("snapkv"):  # evicted first: positions per head survive quantization
        assert out.caches[0].pos.shape == (2, cfg.attention.n_kv_heads, out.caches[0].capacity)


@pytest.mark.parametrize(
    "policy, message",
    [
        ("int:3", "bits=3 must be one of"),
        ("int:2", r"asym=true also allows 2"),
        ("kivi:2:asym", r"unknown option 'asym'; kivi's own options: \['group', 'residual'\]"),
        ("snapkv:0.5:asym", "unknown option 'asym'"),
        ("kivi:8", "bits=8 must be one of"),
        ("kivi:2:residual=40", "multiple of group=32"),
        ("kivi:2+snapkv:0.5", "encode last"),
        ("int:8:every=2", "a quantizer keeps every token"),
        ("kvquant:8", "bits=8 must be one of"),
        ("kvquant:3:outliers=0.7", "outliers=0.7 must be in"),
        ("gear:3", "bits=3 must be one of"),
        ("kivi:2:rank=2", "unknown option 'rank'; kivi's own options"),
    ],
)
def test_bad_quantization_policies(policy, message):
    with pytest.raises(ConfigError, match=message):
        parse_policy(policy)


def test_mla_latents_are_not_quantized_yet(make_model):
    _, mla = make_model("mla", "model.n_layers=2")
    with pytest.raises(ConfigError, match="quantizing or factoring MLA.s latent cache is not implemented"):
        Generator(mla, capacity=16, policy=parse_policy("kivi:2"))


def _kvquant(**kw):
    return QuantSpec("kvquant", **{"bits": 3, "group": 4, "residual": 8, "rope_theta": 10_000.0, **kw})


def test_kvquant_quantizes_keys_before_rope_and_rotates_them_back_at_their_positions():
    from kvjax.rope import rotate

    k_pre, v, pos = _tokens(4, H=16)
    k = rotate(k_pre, pos[:, :, None], 10_000.0)  # what the attention layer hands the cache
    # Everything in full precision (residual and sinks cover the tokens): the view is the input.
    cache, view = _update(QuantKVCache.init(_kvquant(residual=40), 2, 40, 2, 16, jnp.float32), k, v, pos)
    for b, n in enumerate([37, 23]):
        np.testing.assert_allclose(np.asarray(view.k)[b, :, :n], np.asarray(k)[b, :n].transpose(1, 0, 2), atol=1e-5)
    # Quantized: un-rotating the view gives back the pre-RoPE keys within the per-channel group bound
    # (outliers aside), and the sink token and each vector's largest magnitude are exact.
    spec = _kvquant(outliers=0.07, bits=2)  # ceil(0.07 * 16) = 2 outliers per vector
    cache, view = _update(QuantKVCache.init(spec, 2, 40, 2, 16, jnp.float32), k, v, pos)
    for b, n in enumerate([37, 23]):
        q = int(cache.n_quant[b])
        back = np.asarray(rotate(view.k[b : b + 1, :, :q], -jnp.arange(q)[None, None], 10_000.0))[0]
        want = np.asarray(k_pre)[b, :q].transpose(1, 0, 2)  # [K,q,H]
        np.testing.assert_allclose(back[:, 0], want[:, 0], atol=1e-5)  # the sink
        top = np.argsort(-np.abs(want), axis=-1)[..., :2]
        np.testing.assert_allclose(np.take_along_axis(back, top, -1), np.take_along_axis(want, top, -1), atol=1e-5)
        dense = want.copy()
        np.put_along_axis(dense, top, 0.0, -1)
        groups = dense[:, 4:].reshape(2, -1, 4, 16)  # after the sink's group, per channel per 4 tokens
        bound = (np.maximum(groups.max(2), 0) - np.minimum(groups.min(2), 0)) / (2 * 3)
        err = np.abs(back[:, 4:] - want[:, 4:]).reshape(2, -1, 4, 16)
        mask = np.ones_like(want[:, 4:], bool)
        np.put_along_axis(mask, top[:, 4:], False, -1)
        assert (np.where(mask.reshape(err.shape), err, 0).max(2) <= bound + 1e-4).all()


def test_kvquant_after_head_wise_eviction_rotates_each_head_at_its_own_positions(gqa):
    """snapkv then kvquant with everything in the residual: the dequantized, re-rotated keys equal the
    evicted cache's keys, although heads keep different tokens."""
    cfg, model = gqa
    _, gen, lengths, _, (_, caches_q, _) = _plain_and_compressed(
        model, "snapkv:0.5:obs_window=8+kvquant:3:group=2,residual=32"
    )
    _, gen_e, _, _, (_, caches_e, _) = _plain_and_compressed(model, "snapkv:0.5:obs_window=8")
    for q, e in zip(caches_q, caches_e):
        assert q.pos.ndim == 3 and not np.array_equal(q.pos[:, 0], q.pos[:, 1])
        k, v = q.dequantized()
        np.testing.assert_allclose(k[:, :, :20], e.k[:, :, :20], atol=1e-5)
        np.testing.assert_array_equal(v[:, :, :20], e.v[:, :, :20])


# --- low rank (Palu) --------------------------------------------------------------------------------


def test_bases_are_the_data_optimal_rank_r_projection():
    from kvjax.quant.lowrank import bases_from_samples, rank_for

    x = np.random.default_rng(6).normal(size=(200, 2, 4)) * np.array([5, 3, 1, 0.5])  # [N, K, H]
    U = bases_from_samples(x, group=2, rank=rank_for(0.5, 8))  # one group of 2 heads, 8 dims -> 4
    assert U.shape == (1, 8, 4)
    np.testing.assert_allclose(U[0].T @ U[0], np.eye(4), atol=1e-5)  # orthonormal
    X = x.reshape(200, 8)
    residual = np.linalg.norm(X - X @ U[0] @ U[0].T) ** 2
    eig = np.linalg.eigvalsh(X.T @ X)  # ascending
    np.testing.assert_allclose(residual, eig[:4].sum(), rtol=1e-4)  # PCA: the discarded eigenvalues


@pytest.fixture(scope="module")
def calibration(gqa):
    return np.random.default_rng(7).integers(0, gqa[0].vocab_size, (4, 48))


def test_palu_at_full_rank_reconstructs_keys_at_their_positions(gqa, calibration):
    """palu:0 keeps every dimension: after head-wise eviction too, the rebuilt K/V equal the cache's."""
    cfg, model = gqa
    for policy, base in (
        ("palu:0:heads=1", None),
        ("snapkv:0.5:obs_window=8+palu:0:heads=2", "snapkv:0.5:obs_window=8"),
    ):
        gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy), calibration=calibration)
        tokens, lengths = gen.pad(PROMPTS, NEW)
        _, caches, _ = gen.prefill_compressed(tokens, lengths, NEW)
        if base is None:
            _, ref = Generator(model, capacity=CAPACITY).prefill(tokens, lengths)
        else:
            _, ref, _ = Generator(model, capacity=CAPACITY, policy=parse_policy(base)).prefill_compressed(
                tokens, lengths, NEW
            )
        for c, e in zip(caches, ref):
            k, v = c.reconstructed()
            n = e.k.shape[2]
            np.testing.assert_allclose(k[:, :, :n], e.k, atol=1e-5)
            np.testing.assert_allclose(v[:, :, :n], e.v, atol=1e-5)


@pytest.mark.parametrize("policy", ["palu:0.75:heads=1", "streaming:0.5+palu:0.5"])
def test_palu_bytes_equal_analytic(gqa, calibration, policy):
    cfg, model = gqa
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy), calibration=calibration)
    tokens, lengths = gen.pad(PROMPTS, NEW)
    logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    K, H = cfg.attention.n_kv_heads, cfg.attention.head_dim
    g = 1 if "heads=1" in policy else K
    rank = round((1 - float(policy.split("palu:")[1].split(":")[0])) * g * H)
    assert caches[0].zk.shape[1:] == (K // g, caches[0].capacity, rank)
    out = gen.decode(caches, logits, lengths, DecodingConfig(max_new_tokens=NEW), jax.random.key(0), stats)
    assert np.isfinite(out.logprobs).all()


@pytest.mark.parametrize("heads, per_head, window", [(1, False, None), (2, True, None), (2, False, 5)])
def test_palu_decode_attends_in_the_value_latent_space_as_the_rebuilt_cache_does(heads, per_head, window):
    """A decode step over a low-rank cache (XLA) weights the value latents and maps the sum out, never
    reading rebuilt values (NaN values here): equal to attention over the rebuilt K/V, for one and two
    heads per group, positions per head, and a window."""
    from kvjax.ops import attention
    from kvjax.quant.lowrank import LowRankKVCache

    B, S, K, N, H, r = 2, 64, 2, 6, 8, 5
    rng = np.random.default_rng(heads)

    def basis():
        return jnp.asarray(np.linalg.qr(rng.normal(size=(K // heads, heads * H, heads * H)))[0][..., :r], jnp.float32)

    cache = LowRankKVCache(
        zk=jnp.zeros((B, K // heads, S, r)),
        zv=jnp.zeros((B, K // heads, S, r)),
        pos=jnp.full((B, S), -1, jnp.int32),
        length=jnp.zeros((B,), jnp.int32),
        k_basis=basis(),
        v_basis=basis(),
        n_kv_heads=K,
    )
    T = 40
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.where(np.arange(T)[None] < np.array([[40], [29]]), np.arange(T)[None], -1), jnp.int32)
    cache, _ = cache.update(k, v, pos)
    if per_head:  # heads keep different slots, as after head-wise eviction
        cache = cache.replace(pos=jnp.stack([cache.pos, jnp.where(cache.pos % 3 == 0, -1, cache.pos)], axis=1))
    q, q_pos = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32), jnp.array([[40], [29]], jnp.int32)
    cache, view = cache.update(k[:, :1] * 0.5, v[:, :1], q_pos)
    assert view.reader is not None
    want = attention(q, view.k, view.v, q_pos, view.pos, window=window)
    nan_values = view.reader.__class__(cache, view._replace(v=jnp.full_like(view.v, jnp.nan)))
    got = nan_values.attend(q, q_pos, "xla", window)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_palu_needs_calibration_and_a_ratio(gqa):
    with pytest.raises(ConfigError, match="needs calibration data"):
        Generator(gqa[1], capacity=CAPACITY, policy=parse_policy("palu:0.5"))
    with pytest.raises(ConfigError, match="fraction of K/V dimensions removed"):
        parse_policy("palu:64")


@pytest.mark.parametrize("policy", ["int:8", "kivi:2", "kvquant:3", "palu:0.5", "snapkv:0.5:obs_window=8+kivi:4"])
def test_generator_decodes_every_encoder_in_a_roomy_cache(gqa, calibration, policy):
    """`Generator(...)(prompts)` with a capacity above prompt + new tokens (the CLI's case): the
    encoded cache has the planned bytes, and the sampled tokens' log-probabilities equal teacher
    forcing them through the same compressed cache (decode == score)."""
    cfg, model = gqa
    gen = Generator(model, capacity=128, policy=parse_policy(policy), calibration=calibration)
    out = gen(PROMPTS, DecodingConfig(max_new_tokens=NEW))
    _, lengths = gen.pad(PROMPTS, NEW)
    assert caches_nbytes(out.caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, 128)
    logprobs, _ = gen.score(PROMPTS, out.tokens.tolist())
    np.testing.assert_allclose(logprobs, out.logprobs, atol=2e-5)


def test_gear_power_iteration_is_the_reference_subspace_iteration():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(3, 12, 8)).astype(np.float32)
    q, p = low_rank(jnp.asarray(e), 2)
    ref_p = np.broadcast_to(np.asarray(jax.random.uniform(jax.random.key(0), (8, 2))), (3, 8, 2))
    for i in range(3):
        if i == 2:
            ref_p = np.linalg.qr(ref_p)[0]
        ref_q = e @ ref_p
        if i == 2:
            ref_q = np.linalg.qr(ref_q)[0]
        ref_p = e.swapaxes(-1, -2) @ ref_q
    np.testing.assert_allclose(
        np.asarray(q) @ np.asarray(p).swapaxes(-1, -2), ref_q @ ref_p.swapaxes(-1, -2), atol=1e-4
    )
    exact = rng.normal(size=(12, 2)) @ rng.normal(size=(2, 8))  # rank 2: recovered exactly at rank 2
    q, p = low_rank(jnp.asarray(exact, jnp.float32), 2)
    np.testing.assert_allclose(np.asarray(q) @ np.asarray(p).T, exact, atol=1e-4)


def test_gear_without_rank_or_outliers_is_kivi_and_at_full_rank_is_lossless():
    k, v, pos = _tokens(2)
    kivi = QuantSpec("kivi", 2, group=4, residual=8)
    empty = lambda spec: QuantKVCache.init(spec, 2, 48, 2, 8, jnp.float32)  # noqa: E731
    a, view_a = _update(empty(kivi), k, v, pos)
    b, view_b = _update(empty(QuantSpec("gear", 2, group=4, residual=8, outliers=0.0, rank=0)), k, v, pos)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(view_a.k, view_b.k)
    full, view = _update(empty(QuantSpec("gear", 2, group=4, residual=8, outliers=0.0, rank=8)), k, v, pos)
    for row, n in enumerate(np.asarray(full.n_quant)):  # every flushed block's error fully recovered
        np.testing.assert_allclose(view.k[row, :, :n], k.transpose(0, 2, 1, 3)[row, :, :n], atol=1e-4)
        np.testing.assert_allclose(view.v[row, :, :n], v.transpose(0, 2, 1, 3)[row, :, :n], atol=1e-4)
    assert np.abs(np.asarray(view_a.k[0, :, :32]) - np.asarray(k.transpose(0, 2, 1, 3)[0, :, :32])).max() > 0.1


def test_gear_keeps_each_vectors_largest_and_smallest_entries_exactly():
    k, v, pos = _tokens(3)
    spec = QuantSpec("gear", 2, group=4, residual=8, outliers=0.25, rank=1)  # ceil(0.25 x 8 / 2) = 1 each side
    cache, view = _update(QuantKVCache.init(spec, 2, 48, 2, 8, jnp.float32), k, v, pos)
    assert spec.n_outliers(8) == 2
    keys = np.asarray(k.transpose(0, 2, 1, 3))
    for row, n in enumerate(np.asarray(cache.n_quant)):
        for h in range(2):
            for t in range(n):
                chosen = set(np.asarray(cache.outliers.k_idx[row, h, t]).tolist())
                assert chosen == {int(keys[row, h, t].argmax()), int(keys[row, h, t].argmin())}
                np.testing.assert_array_equal(
                    np.asarray(view.k)[row, h, t, sorted(chosen)], keys[row, h, t, sorted(chosen)]
                )


def test_lorc_progressive_keep_preserves_the_budget_and_favours_sensitive_layers():
    keep = progressive_keep(np.array([3.0, 1.0, 2.0, 0.5]), 0.5)
    assert keep.mean() == pytest.approx(0.5)
    assert (np.diff(keep) <= 0).all() and keep[0] == pytest.approx(0.75) and keep.min() >= 0.25  # shallow keeps more
    np.testing.assert_allclose(progressive_keep(np.zeros(4), 0.3), 0.3)  # nothing to rank: uniform
    assert progressive_keep(np.array([1.0, 1.0]), 0.9).max() <= 0.95 + 1e-9


def test_lorc_bases_are_the_weights_top_singular_vectors_and_full_rank_is_lossless(gqa):
    cfg, model = gqa
    bases = lorc_bases(model, (0, 1), 0.5, heads=1)
    K, H = cfg.attention.n_kv_heads, cfg.attention.head_dim
    for layer, (kb, vb) in enumerate(bases):
        for basis, w in ((kb, model.blocks[layer].mixer.k.kernel[...]), (vb, model.blocks[layer].mixer.v.kernel[...])):
            r = basis.shape[-1]
            for g in range(K):
                _, _, vt = np.linalg.svd(np.asarray(w)[:, g * H : (g + 1) * H], full_matrices=False)
                np.testing.assert_allclose(np.asarray(basis[g]) @ np.asarray(basis[g]).T, vt[:r].T @ vt[:r], atol=1e-4)
    assert bases[0][0].shape[-1] != bases[1][0].shape[-1]  # progressive: the layers differ
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("lorc:0"))
    tokens, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(tokens, lengths, NEW)
    _, ref = Generator(model, capacity=CAPACITY).prefill(tokens, lengths)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    for c, e in zip(caches, ref):
        k, v = c.reconstructed()
        np.testing.assert_allclose(k, e.k, atol=1e-4)
        np.testing.assert_allclose(v, e.v, atol=1e-4)
    half = Generator(model, capacity=CAPACITY, policy=parse_policy("lorc:0.5"))
    _, small, _ = half.prefill_compressed(tokens, lengths, NEW)
    assert caches_nbytes(small) == compressed_cache_bytes(cfg, half.compression_plan(lengths, NEW), 2, CAPACITY)
    assert caches_nbytes(small) < caches_nbytes(caches)


@pytest.mark.parametrize("policy", ["palu:0.5", "lorc:0.5", "kvquant:4"])
def test_what_re_rotates_pre_rope_keys_refuses_scaled_rope(make_model, policy):
    """Palu's and LoRC's latents and KVQuant's keys are stored before RoPE and rotated again with plain
    RoPE: on a model with Llama 3's scaled frequencies they refuse by name instead of drifting."""
    _, model = make_model("gqa", "model.n_layers=2", "model.attention.rope_scaling={factor: 8.0}")
    with pytest.raises(ConfigError, match="rope_scaling"):
        Generator(model, capacity=CAPACITY, policy=parse_policy(policy), calibration=np.zeros((1, 8), np.int32))


def test_lorc_refuses_normalized_keys_and_palu_takes_them(make_model):
    """With q/k norms (Qwen3) a key is not in the span of W_k's rows: LoRC's weight bases would not hold
    it, so it refuses by name; Palu's bases come from the keys themselves."""
    _, model = make_model("gqa", "model.n_layers=2", "model.attention.qk_norm=true")
    with pytest.raises(ConfigError, match="normalizes its keys .model.attention.qk_norm.*use palu"):
        Generator(model, capacity=CAPACITY, policy=parse_policy("lorc:0.5"))

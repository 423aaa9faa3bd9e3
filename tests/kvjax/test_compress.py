"""Token-level compression: degenerate budgets change nothing, sinks and windows survive, bytes are exact,
positions stay true, scorers compute what their papers define, and bad policies fail before compute."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvjax import DecodingConfig, Generator
from kvjax.cache import KVCache, KVView, PooledKVCache, QuestKVCache, RingKVCache, caches_nbytes
from kvjax.compress import compressed_cache_bytes, parse_policy, plan_stages
from kvjax.compress.allocators import ALLOCATORS
from kvjax.compress.apply import observe_fn
from kvjax.compress.methods.base import Target
from kvjax.compress.methods.snapkv import pool
from kvjax.compress.policy import BudgetNote, Stage, stage_counts
from kvjax.compress.reducers import protected, top_slots
from kvjax.compress.scorers import observe, score
from kvjax.config import ConfigError
from kvjax.ops import attend, attention, attention_probs, grouped_mask
from kvjax.plan import init_caches
from tests.conftest import GEMMA_LIKE

PROMPTS = [list(range(3, 43)), [7, 1, 9, 4] * 7 + [2]]  # 40 and 29 tokens
NEW = 6
CAPACITY = 40 + NEW
GREEDY = DecodingConfig(max_new_tokens=NEW)
# Small observation windows so that 50% of a 29-token prompt still covers sinks + window.
# One policy per scorer, allocator, reducer, chain and decode-time layout (each compiles its own prefill).
POLICIES = [
    "streaming:0.5",
    "h2o:0.5:normalize=true",
    "snapkv:0.5:obs_window=8,pooling=max,kernel=3",
    "tova:0.5",
    "keynorm:0.5",
    "snapkv:0.5:obs_window=8,allocator=pyramid",
    "h2o:0.5:allocator=adakv",
    "snapkv:0.5:obs_window=8,reducer=cam",
    "h2o:0.5:reducer=kvmerger",
    "streaming:0.5+snapkv:0.5:obs_window=4",
    "h2o:0.5:every=1",
    "scissorhands:0.5:obs_window=8,every=2",
    "snapkv:12:obs_window=4,allocator=adakv,every=2",
    "quest:0.5:page_size=8",
]


@pytest.fixture(scope="module")
def gqa(make_model):
    cfg, model = make_model("gqa", "model.n_layers=2", "model.init_std=0.2")
    return cfg, model


def _generate(model, policy, prompts=PROMPTS, capacity=CAPACITY, new=NEW):
    gen = Generator(model, capacity=capacity, policy=None if policy is None else parse_policy(policy))
    return gen(prompts, DecodingConfig(max_new_tokens=new))


def _plain_and_compressed(model, policy):
    """Both prefills of PROMPTS: (plain generator, compressed one, lengths, plain (logits, caches),
    compressed (logits, caches, stats))."""
    plain = Generator(model, capacity=CAPACITY)
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
    tokens, lengths = plain.pad(PROMPTS, NEW)
    return plain, gen, lengths, plain.prefill(tokens, lengths), gen.prefill_compressed(tokens, lengths, NEW)


def _assert_same_decoding(plain, gen, lengths, caches, caches_c, logits, stats):
    """From the same logits, decoding over the two caches is bitwise the same."""
    ref = plain.decode(caches, logits, lengths, GREEDY, jax.random.key(0))
    out = gen.decode(caches_c, logits, lengths, GREEDY, jax.random.key(0), stats)
    np.testing.assert_array_equal(ref.tokens, out.tokens)
    np.testing.assert_array_equal(ref.logprobs, out.logprobs)


@pytest.mark.parametrize(
    "method",
    [
        "streaming:0",
        "h2o:0",
        "snapkv:0:obs_window=8",
        "snapkv:0:reducer=kvmerger",
        "scissorhands:0:obs_window=8",
        "h2o:0:reducer=cam",
        "keynorm:0:allocator=pyramid,beta=1",
        "quest:0",
    ],
)
def test_a_budget_covering_the_sequence_changes_nothing(gqa, method):
    plain, squeezed, lengths, (logits, caches), (logits_c, caches_c, stats) = _plain_and_compressed(gqa[1], method)
    for a, b in zip(caches, caches_c):
        assert a.k.shape == b.k.shape
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
        np.testing.assert_array_equal(
            np.broadcast_to(a.pos[:, None], b.k.shape[:3]) if b.pos.ndim == 3 else a.pos, b.pos
        )
        np.testing.assert_array_equal(a.length, b.length)
    np.testing.assert_allclose(logits, logits_c, atol=1e-5)
    _assert_same_decoding(plain, squeezed, lengths, caches, caches_c, logits, stats)


@pytest.mark.parametrize("policy", ["h2o:0:every=6", "snapkv:0:obs_window=4,every=6"])
def test_decode_time_observation_without_eviction_changes_nothing(gqa, policy):
    """every=6 with 6 new tokens: 5 decode steps, each observing attention, none evicting."""
    plain, gen, lengths, (logits, caches), (_, caches_c, stats) = _plain_and_compressed(gqa[1], policy)
    _assert_same_decoding(plain, gen, lengths, caches, caches_c, logits, stats)


@pytest.mark.parametrize("policy", POLICIES)
def test_measured_bytes_equal_analytic_and_rows_keep_their_budget(gqa, policy):
    cfg, model = gqa
    pol = parse_policy(policy)
    gen = Generator(model, capacity=CAPACITY, policy=pol)
    tokens, lengths = gen.pad(PROMPTS, NEW)
    logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
    plans = gen.compression_plan(lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, plans, len(PROMPTS), CAPACITY)
    last = plans[-1]
    K = cfg.attention.n_kv_heads
    for j, cache in enumerate(caches):
        if isinstance(cache, QuestKVCache):  # keeps everything; reads pages
            np.testing.assert_array_equal(cache.length, lengths)
            assert cache.read_pages == 3 and cache.page_min.shape[2] == -(-CAPACITY // 8)
            continue
        per_head = last.counts[j] * (K if isinstance(cache, PooledKVCache) else 1)
        np.testing.assert_array_equal(cache.length, per_head)
        valid = (cache.pos >= 0).reshape(len(PROMPTS), -1).sum(axis=1)
        expected = per_head if isinstance(cache, PooledKVCache) or cache.pos.ndim == 2 else per_head * K
        np.testing.assert_array_equal(valid, expected)
    out = gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
    assert caches_nbytes(out.caches) == caches_nbytes(caches)
    assert out.tokens.shape == (2, NEW) and np.isfinite(out.logprobs).all()


def _positions_by_head(cache):
    """{(row, head): sorted kept positions} of a KV or pooled cache."""
    B = cache.pos.shape[0]
    if isinstance(cache, PooledKVCache):
        return {
            (b, h): sorted(np.asarray(cache.pos[b])[(np.asarray(cache.head[b]) == h) & (np.asarray(cache.pos[b]) >= 0)])
            for b in range(B)
            for h in range(int(cache.head.max()) + 1)
        }
    pos = np.asarray(cache.pos if cache.pos.ndim == 3 else cache.pos[:, None])
    K = cache.k.shape[1]
    return {
        (b, h): sorted(pos[b, min(h, pos.shape[1] - 1)][pos[b, min(h, pos.shape[1] - 1)] >= 0])
        for b in range(B)
        for h in range(K)
    }


@pytest.mark.parametrize(
    "policy",
    [
        "streaming:0.5",
        "snapkv:0.5:obs_window=8",
        "keynorm:0.5:sinks=2,window=3",
        "snapkv:0.5:obs_window=8,allocator=adakv",
    ],
)
def test_kept_entries_are_the_original_tokens_at_their_true_positions(gqa, policy):
    cfg = gqa[0]
    _, _, lengths, (_, full), (_, caches, _) = _plain_and_compressed(gqa[1], policy)
    stage = parse_policy(policy).stages[0]
    for c_full, c in zip(full, caches):
        k_full = np.asarray(c_full.k)  # [B,K,S,H]; slot == position in an uncompressed cache
        for (b, h), kept in _positions_by_head(c).items():
            n = int(lengths[b])
            keep = stage.keep(n)
            assert len(set(kept)) == len(kept)
            assert len(kept) == keep or isinstance(c, PooledKVCache)  # AdaKV heads differ; totals below
            must = set(range(min(stage.n_sinks, n))) | set(range(n - stage.n_window(keep), n))
            assert must <= set(kept), (b, h, sorted(must - set(kept)))
            if isinstance(c, PooledKVCache):
                rows = np.asarray(c.pos[b]) >= 0
                assert rows.sum() == keep * cfg.attention.n_kv_heads
                for p, hh, kv in zip(np.asarray(c.pos[b])[rows], np.asarray(c.head[b])[rows], np.asarray(c.k[b])[rows]):
                    np.testing.assert_array_equal(kv, k_full[b, hh, p])
            else:
                pos = np.asarray(c.pos if c.pos.ndim == 3 else c.pos[:, None])
                slots = np.flatnonzero(pos[b, min(h, pos.shape[1] - 1)] >= 0)
                np.testing.assert_array_equal(
                    np.asarray(c.k)[b, h, slots], k_full[b, h, pos[b, min(h, pos.shape[1] - 1), slots]]
                )
                assert list(pos[b, min(h, pos.shape[1] - 1), slots]) == kept  # compacted in position order


@pytest.mark.parametrize("policy", ["h2o:0.5:every=2", "h2o:0.5:allocator=adakv,every=2"])
def test_new_tokens_keep_their_true_positions_after_eviction(gqa, policy):
    cfg, model = gqa
    out = _generate(model, policy)
    K = cfg.attention.n_kv_heads
    for cache in out.caches:
        for (b, h), kept in _positions_by_head(cache).items():
            n = len(PROMPTS[b])
            newest = n + NEW - 2  # the last fed token (the last sampled one is never fed)
            assert kept[-1] == newest and len(set(kept)) == len(kept)
            assert set(kept) - set(range(n)) <= set(range(n, newest + 1))
        if isinstance(cache, PooledKVCache):  # the newest token went to every head, tagged with it
            for b, n in enumerate(len(p) for p in PROMPTS):
                heads = np.asarray(cache.head[b])[np.asarray(cache.pos[b]) == n + NEW - 2]
                assert sorted(heads) == list(range(K))


def test_h2o_accumulates_attention_of_every_prompt_and_decode_query(gqa):
    """With no eviction (ratio 0, every > steps) the running statistic after decoding is the attention
    each key received from every query, prompt and generated, summed (averaged over the query group)."""
    from flax import nnx

    cfg, model = gqa
    out = _generate(model, "h2o:0:every=6")
    stage = parse_policy("h2o:0").stages[0]
    for b, prompt in enumerate(PROMPTS):
        seq = np.asarray([prompt + out.tokens[b, : NEW - 1].tolist()])
        T = seq.shape[1]
        graphdef, params = nnx.split(model)

        _, _, observed = nnx.merge(graphdef, params).observe(
            jnp.asarray(seq), jnp.arange(T)[None], init_caches(cfg, 1, T), jnp.arange(T)[None], observe_fn((stage,))
        )
        for slot, stat in enumerate(out.stats):
            np.testing.assert_allclose(np.asarray(stat)[b, :, :T], np.asarray(observed[slot][0])[0], atol=1e-5)


def test_h2o_observes_a_whole_prompt_a_block_of_queries_at_a_time(gqa, monkeypatch):
    """H2O's statistic sums over every prompt query, so the prefill observes them OBS_BLOCK at a time
    (a scan) and adds the blocks: the same tokens and statistic as one block, and no intermediate the
    size of [prompt, cache] exists (at 1,024 tokens in blocks of 128)."""
    import kvjax.architectures.decoder as decoder
    from kvjax.generate import _programs

    cfg, model = gqa
    outs = []
    for block in (10**9, 8):  # one block; 40-token prompts in 5
        monkeypatch.setattr(decoder, "OBS_BLOCK", block)
        _programs.cache_clear()  # trace again under this block size
        outs.append(_generate(model, "h2o:0.5:every=4"))
    want, got = outs
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    for a, b in zip(got.stats, want.stats):
        np.testing.assert_allclose(a, b, atol=1e-5)
    monkeypatch.setattr(decoder, "OBS_BLOCK", 128)
    T, stage = 1024, parse_policy("h2o:0.5").stages[0]
    caches = init_caches(cfg, 1, T, fresh=True)  # as a prefill's: the chunk attends in causal blocks
    jaxpr = jax.make_jaxpr(
        lambda t: model.observe(t, jnp.arange(T)[None], caches, jnp.arange(T)[None], observe_fn((stage,)))
    )(jnp.zeros((1, T), jnp.int32))

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    assert not [s for s in shapes(jaxpr.jaxpr) if sum(d >= T for d in s) >= 2]


def test_streaming_keeps_exactly_sinks_and_recent_tokens_during_decoding(gqa):
    cfg, model = gqa
    out = _generate(model, "streaming:10:sinks=4,every=1", new=12)
    for b, n in enumerate(len(p) for p in PROMPTS):
        last = n + 12 - 2
        expected = list(range(4)) + list(range(last - 5, last + 1))
        assert sorted(np.asarray(out.caches[0].pos[b])[np.asarray(out.caches[0].pos[b]) >= 0]) == expected


@pytest.mark.parametrize("policy", ["streaming:256:every=1", "h2o:64:every=2"])
def test_a_decode_time_budget_is_a_cap_prompts_below_it_decode_as_without_compression(gqa, policy):
    """Rows shorter than a decode-time size budget keep every token: generation equals the plain one
    until a row grows past the cap (never here)."""
    cfg, model = gqa
    ref = _generate(model, None, new=12, capacity=64)
    out = _generate(model, policy, new=12, capacity=64)
    np.testing.assert_array_equal(ref.tokens, out.tokens)
    np.testing.assert_allclose(ref.logprobs, out.logprobs, atol=1e-5)
    np.testing.assert_array_equal(out.caches[0].length, [len(p) + 12 - 1 for p in PROMPTS])


def test_jitted_equals_not_jitted(gqa):
    """The compression itself (top-k, merge, gather, layouts) run eagerly equals its jitted run."""
    from kvjax.compress import compress_caches, compressible

    cfg, model = gqa
    plain = Generator(model, capacity=CAPACITY)
    tokens, lengths = plain.pad(PROMPTS, NEW)
    _, caches = plain.prefill(tokens, lengths)
    for policy in ("keynorm:0.5:reducer=kvmerger", "streaming:0.5+keynorm:0.5:allocator=adakv"):
        plans = plan_stages(cfg, parse_policy(policy).stages, lengths, headroom=NEW)
        args = (
            caches,
            (None, None),
            tuple(p.static for p in plans),
            tuple(p.arrays for p in plans),
            jnp.asarray(lengths - 1),
            compressible(cfg),
        )
        jitted, _ = jax.jit(compress_caches, static_argnums=(2, 5))(*args)
        with jax.disable_jit():
            eager, _ = compress_caches(*args)
        for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
            np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("policy", ["snapkv:0.5:obs_window=8", "h2o:0.5:every=2"])
def test_a_batch_of_ragged_prompts_equals_each_prompt_alone(gqa, policy):
    cfg, model = gqa
    batch = _generate(model, policy)
    for row, prompt in enumerate(PROMPTS):
        alone = _generate(model, policy, prompts=[prompt])
        np.testing.assert_array_equal(batch.tokens[row], alone.tokens[0])
        np.testing.assert_allclose(batch.logprobs[row], alone.logprobs[0], atol=1e-5)


# --- scorers against their definitions -------------------------------------------------------------


def _probs(seed=0, B=2, K=2, G=3, T=9, H=4):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, K * G, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32)
    pos = jnp.asarray(np.where(np.arange(T)[None] < np.array([[T], [T - 3]]), np.arange(T)[None], -1), jnp.int32)
    return attention_probs(q, k, k, pos, pos), pos


def test_attention_probs_are_what_attention_uses():
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(2, 5, 6, 4)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(2, 3, 7, 4)), jnp.float32) for _ in range(2))
    qp, kp = jnp.tile(jnp.arange(2, 7)[None], (2, 1)), jnp.tile(jnp.arange(7)[None], (2, 1))
    np.testing.assert_allclose(attend(attention_probs(q, k, v, qp, kp), v), attention(q, k, v, qp, kp), atol=1e-6)


def test_h2o_snapkv_tova_statistics_follow_their_definitions():
    probs, pos = _probs()
    p = np.asarray(probs)  # [B,K,T,G,S]
    lengths = np.array([9, 6])
    h2o = np.asarray(observe(Stage("h2o", ratio=0.5), probs, pos, pooled=False))
    np.testing.assert_allclose(h2o, p.sum(axis=2).mean(axis=2), rtol=1e-6)  # every query's attention, summed
    snap = np.asarray(observe(Stage.of("snapkv", ratio=0.5, obs_window=4), probs, pos, pooled=False))
    for b, n in enumerate(lengths):
        want = p[b, :, n - 4 : n].sum(axis=1).mean(axis=1)  # the last 4 real queries only
        np.testing.assert_allclose(snap[b], want, rtol=1e-6)
        tova = np.asarray(observe(Stage("tova", ratio=0.5), probs, pos, pooled=False))
        np.testing.assert_allclose(tova[b, 0], p[b, :, n - 1].mean(axis=(0, 1)), rtol=1e-6)
    x = np.arange(7, dtype=np.float32)[None, None]
    np.testing.assert_allclose(pool(jnp.asarray(x), 3, "avg"), [[[1 / 3, 1, 2, 3, 4, 5, 11 / 3]]], rtol=1e-6)
    np.testing.assert_allclose(pool(jnp.asarray(x), 3, "max"), [[[1, 2, 3, 4, 5, 6, 6]]])


def test_scissorhands_counts_below_average_attention_over_its_history_window():
    probs, pos = _probs()
    p = np.asarray(probs)  # [B,K,T,G,S]
    visible = grouped_mask(pos, pos, None, None, 2)
    counts = np.asarray(observe(Stage.of("scissorhands", ratio=0.5, obs_window=4), probs, pos, False, visible))
    for b, n in enumerate([9, 6]):
        want = np.zeros((2, 9))
        for q in range(n - 4, n):  # the last 4 real queries; query q sees q + 1 keys
            want[:, : q + 1] += (p[b, :, q, :, : q + 1] < 1 / (q + 1)).sum(axis=1)
        np.testing.assert_array_equal(counts[b], want)
    stage = Stage("scissorhands", ratio=0.5)
    cache = KVCache.init(1, 4, 1, 2, jnp.float32).replace(pos=jnp.arange(4)[None], length=jnp.array([4]))
    scores = np.asarray(score(stage, cache, jnp.asarray([[[2.0, 1.0, 1.0, 0.0]]]), jnp.array([3])))
    assert list(np.argsort(-scores[0, 0])) == [3, 2, 1, 0]  # fewest counts first; a tie keeps the newer


def test_snapkv_pools_the_keys_before_the_window_only():
    """The reference pools attention over keys[:-w] with zero padding (kvpress / SnapKV's code): slots
    next to the window must not average in the attention that window keys received."""
    rng = np.random.default_rng(3)
    B, K, S, w, kernel = 2, 2, 20, 4, 5
    lengths = np.array([20, 13])
    stat = rng.random((B, K, S)).astype(np.float32)
    stat[:, :, 12:] += 100.0  # heavy attention on late keys: inside row 1's window, and row 0's too
    pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1).astype(np.int32)
    stat[pos[:, None].repeat(K, 1) < 0] = 0.0
    stage = Stage.of("snapkv", ratio=0.5, obs_window=w, kernel=kernel)
    got = np.asarray(
        score(
            stage,
            KVCache.init(B, S, K, 4, jnp.float32).replace(pos=jnp.asarray(pos)),
            jnp.asarray(stat),
            jnp.asarray(lengths - 1),
        )
    )
    for b, n in enumerate(lengths):
        before = np.pad(stat[b, :, : n - w], ((0, 0), (kernel // 2, kernel // 2)))
        want = np.stack([np.convolve(row, np.ones(kernel) / kernel, mode="valid") for row in before])
        np.testing.assert_allclose(got[b, :, : n - w], want, rtol=1e-5)


# --- reducers and allocators as properties ----------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    K=st.integers(1, 4),
    sinks=st.integers(0, 4),
    window=st.integers(0, 6),
    keep_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_top_slots_keeps_budget_sinks_window_then_the_best(lengths, K, sinks, window, keep_frac, seed):
    S = 40
    r = np.random.default_rng(seed)
    L = np.array(lengths)
    counts = np.array([min(n, max(min(n, sinks + window), int(n * keep_frac))) for n in L])
    pos = np.where(np.arange(S)[None] < L[:, None], np.arange(S)[None], -1)
    pos3 = np.broadcast_to(pos[:, None], (len(L), K, S))
    scores = r.normal(size=(len(L), K, S)).astype(np.float32)
    select = jax.jit(top_slots, static_argnums=3, static_argnames="sinks")
    idx, valid = select(
        jnp.asarray(scores),
        jnp.asarray(pos3),
        jnp.asarray(counts),
        int(counts.max()),
        sinks=sinks,
        window=jnp.full(len(L), window),
        last_pos=jnp.asarray(L - 1),
    )
    idx, valid = np.asarray(idx), np.asarray(valid)
    prot = np.asarray(protected(jnp.asarray(pos3), sinks, jnp.full(len(L), window), jnp.asarray(L - 1)))
    for b, n in enumerate(L):
        for h in range(K):
            kept = idx[b, h][valid[b, h]]
            assert len(kept) == counts[b] and len(set(kept)) == counts[b] and (kept < n).all()
            assert list(kept) == sorted(kept)
            assert set(np.flatnonzero(prot[b, h])) <= set(kept)
            others = [s for s in range(n) if not prot[b, h, s]]
            chosen = [s for s in kept if not prot[b, h, s]]
            if chosen and len(chosen) < len(others):
                dropped = set(others) - set(chosen)
                assert min(scores[b, h, chosen]) >= max(scores[b, h, list(dropped)])


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(8, 200), min_size=1, max_size=3), ratio=st.floats(0.0, 0.9), layers=st.integers(2, 8)
)
@example(lengths=[200], ratio=0.85, layers=2)  # 200 x 0.15 = 30.000000000000004: float noise at a .5
def test_allocators_budgets(lengths, ratio, layers):
    L = np.array(lengths)
    stage = Stage("streaming", ratio=ratio, sinks=0, window=1)
    keep = np.maximum([int(n * (1 - ratio) + 1e-9) for n in L], 1)  # a ratio keeps at least one token
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetNote)
        uniform = stage_counts(stage, L, layers)
    np.testing.assert_array_equal(uniform, np.broadcast_to(keep, (layers, len(L))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetNote)
        pyr = stage_counts(Stage("streaming", ratio=ratio, sinks=0, window=1, allocator="pyramid"), L, layers)
    assert (np.diff(pyr, axis=0) <= 0).all()  # shrinks with depth
    assert (pyr >= 1).all() and (pyr <= L[None]).all()
    # the layers spend the uniform budget in all, up to rounding (exactly, for a whole budget)
    target = L * (1 - ratio)
    assert (np.abs(pyr.sum(axis=0) - layers * target) <= layers / 2 + 1e-6).all()
    whole = np.isclose(target, np.round(target))
    np.testing.assert_array_equal(pyr.sum(axis=0)[whole], layers * np.round(target[whole]))


def test_pyramid_budgets_follow_the_reference_schedule():
    """Hand-computed from PyramidKV's rule as kvpress computes it (w = the 8-token observation window)."""
    stage = Stage.of("snapkv", ratio=0.5, obs_window=8, allocator="pyramid")
    # k = 50: max 2k - k/20 = 97.5 is above 100 - 8, so max = 92 and min = 100 - 92 = 8; step 28.
    np.testing.assert_array_equal(ALLOCATORS["pyramid"].layer_counts(stage, 100, 4), [92, 64, 36, 8])
    # k = 1000 of 2000: min 50, max 1950 (below 2000 - 8): step 633.3, rounded; sums to 4 x 1000.
    np.testing.assert_array_equal(ALLOCATORS["pyramid"].layer_counts(stage, 2000, 4), [1950, 1317, 683, 50])
    # k = 200 of 1000 (ratio 0.8): min 10 is below the window, so every layer keeps k (kvpress's fallback).
    np.testing.assert_array_equal(
        ALLOCATORS["pyramid"].layer_counts(Stage.of("snapkv", ratio=0.8, obs_window=32, allocator="pyramid"), 1000, 4),
        [200] * 4,
    )
    # The case: 30 layers, 300 tokens, 20% removed: the layers spend exactly 30 x 240.
    short = ALLOCATORS["pyramid"].layer_counts(Stage("snapkv", ratio=0.2, allocator="pyramid"), 300, 30)
    assert short.sum() == 30 * 240 and short[0] == 300 - 32


def test_adakv_pools_snapkv_scores_per_head(gqa):
    """AdaKV over SnapKV pools each head's statistic before the heads share one top-k (kvpress and
    AdaKV's code): the pool's scores equal the dense per-head pooled scores, and the kernel matters."""
    from kvjax.compress.apply import reduce_cache
    from kvjax.compress.reducers import to_pool

    rng = np.random.default_rng(0)
    B, K, S, H = 1, 2, 20, 4
    pos = jnp.asarray(np.arange(S)[None].astype(np.int32))  # full: head 0's last entry meets head 1's first
    cache = KVCache(
        k=jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32),
        v=jnp.zeros((B, K, S, H)),
        pos=pos,
        length=jnp.array([S]),
    )
    stat = np.zeros((B, K, S), np.float32)
    stat[0, 0, [3, 11, 18]] = 5.0  # spikes: pooling spreads them to their own head's neighbours only
    stat[0, 1, [6, 7]] = 4.0
    stat = jnp.asarray(stat)
    last = jnp.array([S - 1])
    for kernel in (3, 5):
        stage = Stage.of("snapkv", ratio=0.5, obs_window=1, kernel=kernel, allocator="adakv")
        dense = score(stage, cache, stat, last)  # [B,K,S], pooled per head
        pool, pooled_stat = to_pool(cache, stat)
        np.testing.assert_allclose(score(stage, pool, pooled_stat, last), dense.reshape(B, 1, K * S), atol=1e-6)

    def kept(kernel):
        stage = Stage.of("snapkv", ratio=0.5, obs_window=4, kernel=kernel, allocator="adakv", floor=0.0)
        target = Target(keep_cap=20, capacity=20, rope_theta=10_000.0)
        out, _ = reduce_cache(stage, cache, [stat], jnp.array([10]), jnp.array([4]), jnp.array([0]), last, target, K)
        return {(int(h), int(p)) for h, p in zip(np.asarray(out.head[0]), np.asarray(out.pos[0])) if p >= 0}

    assert kept(1) != kept(5)


def test_chained_policies_multiply_keep_fractions(gqa):
    cfg, _ = gqa
    plans = plan_stages(cfg, parse_policy("streaming:0.5+tova:0.5").stages, [40, 29], headroom=3)
    np.testing.assert_array_equal(plans[0].counts[0], [20, 14])
    np.testing.assert_array_equal(plans[1].counts[0], [10, 7])
    assert plans[1].capacities == (13, 13) and plans[0].capacities == (20, 20)


def test_adakv_pool_spends_k_times_the_budget_with_a_floor_per_head(gqa):
    cfg, model = gqa
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("h2o:0.5:allocator=adakv,floor=0.5"))
    tokens, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(tokens, lengths, NEW)
    K = cfg.attention.n_kv_heads
    for cache in caches:
        assert isinstance(cache, PooledKVCache) and cache.capacity == K * (20 + NEW)
        for b, n in enumerate(lengths):
            heads = np.asarray(cache.head[b])[np.asarray(cache.pos[b]) >= 0]
            assert len(heads) == K * (n // 2)
            per_head = np.bincount(heads, minlength=K)
            assert (per_head >= (n // 2) // 2).all()  # floor = 0.5 x the uniform share


def test_pooled_attention_equals_per_head_attention():
    r = np.random.default_rng(3)
    B, K, G, S, H = 2, 3, 2, 6, 4
    q = jnp.asarray(r.normal(size=(B, 1, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
    pos = jnp.tile(jnp.arange(S)[None], (B, 1))
    ref = attention(q, k, v, jnp.full((B, 1), S), pos)
    cache = KVCache(k=k, v=v, pos=pos, length=jnp.full((B,), S, jnp.int32))
    from kvjax.compress.reducers import to_pool

    pooled, _ = to_pool(cache)
    order = r.permutation(K * S)  # a pool's order does not matter
    out = attention(
        q,
        pooled.k[:, order],
        pooled.v[:, order],
        jnp.full((B, 1), S),
        pooled.pos[:, order],
        k_head=pooled.head[:, order],
        n_kv_heads=K,
    )
    np.testing.assert_allclose(out, ref, atol=1e-6)


def test_kvmerger_merges_an_evicted_key_into_its_most_similar_kept_key():
    from kvjax.compress.reducers import merge_kvmerger

    k = jnp.asarray([[[[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]]]])  # [1,1,3,2]; token 2 is closer to token 0
    v = jnp.asarray([[[[1.0], [2.0], [4.0]]]])
    cache = KVCache(k=k, v=v, pos=jnp.arange(3)[None], length=jnp.array([3]))
    idx, valid = jnp.asarray([[[0, 1]]]), jnp.ones((1, 1, 2), bool)
    merged = merge_kvmerger(cache, idx, valid, sigma=1.0)
    w = np.exp(-(2 - 2 * 0.8) / 2)
    np.testing.assert_allclose(merged.v[0, 0, :, 0], [(1 + w * 4) / (1 + w), 2.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(merged.k[0, 0, 0], (np.array([1, 0]) + w * np.array([0.8, 0.6])) / (1 + w), rtol=1e-6)


def test_cam_merges_an_evicted_value_into_the_next_kept_one():
    from kvjax.compress.reducers import merge_cam

    v = jnp.asarray([[[[1.0], [2.0], [4.0], [8.0]]]])
    cache = KVCache(k=v, v=v, pos=jnp.arange(4)[None], length=jnp.array([4]))
    attn = jnp.asarray([[[0.4, 0.1, 0.2, 0.3]]])
    idx, valid = jnp.asarray([[[0, 2]]]), jnp.ones((1, 1, 2), bool)  # token 1 -> 2, token 3 -> 2 (none after)
    merged = merge_cam(cache, idx, valid, attn)
    p1, p3 = 0.1 / 0.2, min(1.0, 0.3 / 0.2)
    np.testing.assert_allclose(merged.v[0, 0, :, 0], [1.0, 2.0, (4 + p1 * 2 + p3 * 8) / (1 + p1 + p3), 8.0], rtol=1e-6)
    np.testing.assert_array_equal(merged.k, cache.k)


# --- other variants and bad input -------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["cla2", "mla", "yoco-swa"])
def test_policies_run_on_every_token_cache_with_exact_bytes(make_model, variant):
    cfg, model = make_model(variant, "model.n_layers=4")
    for policy in ("snapkv:0.5:obs_window=8", "streaming:0.5:every=2"):
        gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
        tokens, lengths = gen.pad(PROMPTS, NEW)
        logits, caches, stats = gen.prefill_compressed(tokens, lengths, NEW)
        plans = gen.compression_plan(lengths, NEW)
        assert caches_nbytes(caches) == compressed_cache_bytes(cfg, plans, 2, CAPACITY)
        out = gen.decode(caches, logits, lengths, GREEDY, jax.random.key(0), stats)
        assert np.isfinite(out.logprobs).all()


@pytest.mark.parametrize(
    "policy, message",
    [
        ("snapkv:20", "would keep 20, below the 32 tokens always kept (sinks 0 + window 32"),
        ("streaming:64", "above row 0's sequence of 40 tokens"),
        ("magic:0.5", "method='magic' must be one of"),
        ("h2o:1.5", "size '1.5' must be a whole number"),
        ("h2o", "write method:budget"),
        ("h2o:0.5:colour=red", "unknown option 'colour'"),
        ("h2o:0.5:every=x", "every='x' is not a valid int"),
        ("h2o:0.5:allocator=fancy", "allocator='fancy' must be one of"),
        ("h2o:0.5:every=1+tova:0.5", "every= is allowed on the last stage only"),
        ("keynorm:0.5:reducer=cam", "reducer='cam' weighs merges by attention"),
        ("h2o:0.5:allocator=adakv+tova:0.5", "must be the last stage"),
        ("snapkv:0.5:kernel=4", "kernel=4 must be odd"),
        ("snapkv:0.5:beta=10", "option 'beta' belongs to allocator pyramid; add allocator=pyramid"),
        ("h2o:0.5:allocator=pyramid,beta=0.5", "beta=0.5 must be >= 1"),
        ("h2o:0.5:reducer=kvmerger,sigma=0", "sigma=0.0 must be > 0"),
        ("h2o:0.5:allocator=adakv,floor=2", "floor=2.0 must be in [0, 1]"),
    ],
)
def test_bad_policies_fail_before_compute(gqa, policy, message):
    cfg, model = gqa
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+").replace("[", r"\[")):
        gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
        gen.compression_plan(np.array([40, 29]), NEW)


def test_a_size_below_the_protected_tokens_says_what_it_adds_up_to():
    with pytest.raises(
        ConfigError,
        match=r"keep 2, below the 5 tokens always kept \(sinks 0 \+ window 32, capped at "
        r"the row's 5 tokens\)",
    ):
        stage_counts(parse_policy("snapkv:2").stages[0], np.array([5]), 1)


def test_a_ratio_below_the_protected_tokens_keeps_them_with_a_note():
    """A ratio is a request (issue 38): rows whose budget falls below sinks + window keep those tokens
    (the whole row when it is shorter), other rows keep int(L (1 - r)); the raise is noted once."""
    with pytest.warns(BudgetNote, match="keep fewer tokens than the 32 it always keeps"):
        counts = stage_counts(parse_policy("snapkv:0.5").stages[0], np.array([5, 40, 100]), 2)
    np.testing.assert_array_equal(counts, [[5, 32, 50]] * 2)
    with pytest.warns(BudgetNote):  # PyramidKV leaves a raised row uniform across layers
        counts = stage_counts(parse_policy("snapkv:0.3:allocator=pyramid").stages[0], np.array([20, 1000]), 3)
    np.testing.assert_array_equal(counts[:, 0], [20, 20, 20])
    assert counts[:, 1].sum() == 3 * 700 and counts[0, 1] > counts[2, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to note when every row meets its budget
        stage_counts(parse_policy("snapkv:0.5").stages[0], np.array([100]), 1)


def test_adakv_floor_goes_to_real_tokens_when_a_scorer_rates_empty_slots_highest():
    """Key norm scores an empty (zero) key 0, above every real key's -||k||: each head's guaranteed
    floor must still go to its own real tokens (issue 38; it used to go to empty slots, then be dropped)."""
    K, real, empty = 3, 30, 8
    scores = np.zeros((K, real + empty), np.float32)
    scores[0, :real] = -10 - np.arange(real)  # head 0's real keys all rank below the other heads'
    scores[1:, :real] = -1 - 0.01 * np.arange(real)
    pos = np.tile(np.r_[np.arange(real), -np.ones(empty)], (K, 1)).astype(np.int32)
    head = np.repeat(np.arange(K), real + empty)[None, None]
    idx, valid = top_slots(
        jnp.asarray(scores.reshape(1, 1, -1)),
        jnp.asarray(pos.reshape(1, 1, -1)),
        jnp.array([60]),
        60,
        sinks=0,
        window=jnp.array([0]),
        last_pos=jnp.array([real - 1]),
        floor=jnp.array([4]),
        head=jnp.asarray(head),
    )
    kept = head[0, 0][np.asarray(idx[0, 0])][np.asarray(valid[0, 0])]
    np.testing.assert_array_equal(np.bincount(kept, minlength=K), [4, 28, 28])


def test_models_without_a_token_cache_or_methods_mla_cannot_use_are_refused(make_model):
    _, mamba = make_model("mamba", "model.n_layers=2")
    with pytest.raises(ConfigError, match="nothing for a token-level policy to compress"):
        Generator(mamba, capacity=16, policy=parse_policy("snapkv:0.5"))
    _, mla = make_model("mla", "model.n_layers=2")
    per_head = ("keynorm:0.5", "quest:0.5", "duo:0.5", "snapkv:0.5+think:0.4")  # each needs per-head keys
    for policy in (*per_head, "h2o:0.5:allocator=adakv", "h2o:0.5:reducer=cam"):
        with pytest.raises(ConfigError, match="MLA layers"):
            Generator(mla, capacity=16, policy=parse_policy(policy))


def test_policy_text_round_trips():
    for text in ("snapkv:0.5", "streaming:512:sinks=2", "h2o:0.25:every=4,normalize=True", "tova:0.5+keynorm:0.5"):
        pol = parse_policy(text)
        assert parse_policy(str(pol)) == pol


def test_observe_fn_gives_one_statistic_per_stage():
    probs, pos = _probs()
    stages = parse_policy("h2o:0.5+streaming:0.5").stages
    out = observe_fn(stages)(probs, pos, None)
    assert len(out) == 2 and out[0].shape == (2, 2, 9) and out[1] is None


@pytest.mark.parametrize("window", [None, 20])
def test_quest_reads_the_pages_with_the_highest_upper_bound_and_the_bound_holds(window):
    """...and with a sliding window (a compressed ring), only pages that still hold a token the query sees
    are candidates."""
    r = np.random.default_rng(5)
    B, K, G, S, H, ps = 2, 2, 3, 37, 4, 8
    k = jnp.asarray(r.normal(size=(B, K, S, H)), jnp.float32)
    lengths = np.array([37, 20])
    pos = jnp.asarray(np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1), jnp.int32)
    cache = QuestKVCache.from_cache(KVCache(k=k, v=k, pos=pos, length=jnp.asarray(lengths, jnp.int32)), ps, 2)
    q = jnp.asarray(r.normal(size=(B, 1, K * G, H)), jnp.float32)
    view = cache.select(q, KVView(cache.k, cache.v, cache.pos), jnp.asarray(lengths[:, None] - 1), window)
    for b, n in enumerate(lengths):
        pages = -(-n // ps)
        for h in range(K):
            qk = np.einsum("gh,sh->gs", np.asarray(q[b, 0, h * G : (h + 1) * G]), np.asarray(k[b, h, :n]))
            kb = np.asarray(k[b, h, :n])
            bound = []
            for p in range(pages):
                lo, hi = kb[p * ps : (p + 1) * ps].min(0), kb[p * ps : (p + 1) * ps].max(0)
                qg = np.asarray(q[b, 0, h * G : (h + 1) * G])
                bound.append(np.maximum(qg * lo, qg * hi).sum(-1).max())
                assert bound[-1] >= qk[:, p * ps : (p + 1) * ps].max() - 1e-5  # an upper bound per page
            newest = (n - 1) // ps
            seen = [p for p in range(pages) if window is None or min((p + 1) * ps, n) - 1 > n - 1 - window]
            best = [p for p in np.argsort(bound)[::-1] if p != newest and p in seen][:1]
            read = sorted({int(x) // ps for x in np.asarray(view.pos[b, h]) if x >= 0})
            assert read == sorted({newest, *best})
            for p in read:  # a read page is read whole, at its true positions
                expect = list(range(p * ps, min((p + 1) * ps, n)))
                assert [int(x) for x in np.asarray(view.pos[b, h]) if x // ps == p and x >= 0] == expect
            assert view.k.shape[2] == 2 * ps  # only the read pages are gathered
            # the reference: every slot read, those outside the chosen pages masked
            masked = np.where(np.isin(np.arange(S) // ps, read) & (np.arange(S) < n), np.arange(S), -1)
            q_h = q[b : b + 1, :, h * G : (h + 1) * G]
            ref = attention(
                q_h,
                k[b : b + 1, h : h + 1],
                k[b : b + 1, h : h + 1],
                jnp.asarray([[n - 1]]),
                jnp.asarray(masked)[None, None],
            )
            out = attention(
                q_h,
                view.k[b : b + 1, h : h + 1],
                view.v[b : b + 1, h : h + 1],
                jnp.asarray([[n - 1]]),
                view.pos[b : b + 1, h : h + 1],
            )
            np.testing.assert_allclose(out, ref, atol=1e-6)


def test_quest_decode_appends_to_page_bounds(gqa):
    cfg, model = gqa
    out = _generate(model, "quest:0.5:page_size=8")
    for cache in out.caches:
        ref = QuestKVCache.from_cache(KVCache(k=cache.k, v=cache.v, pos=cache.pos, length=cache.length), 8, 3)
        np.testing.assert_array_equal(cache.page_min, ref.page_min)
        np.testing.assert_array_equal(cache.page_max, ref.page_max)


def test_scoring_a_continuation_equals_the_full_forward_without_compression(gqa):
    cfg, model = gqa
    cont = [[5, 6, 7, 8, 9, 10], [11, 3, 3, 2, 1, 0]]
    logp, full = Generator(model, capacity=CAPACITY).score(PROMPTS, cont, keep_logits=True)
    for row, prompt in enumerate(PROMPTS):
        seq = jnp.asarray([prompt + cont[row]])
        logits, _ = model(seq, jnp.arange(seq.shape[1])[None])
        ref = jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1])
        np.testing.assert_allclose(full[row], ref, atol=5e-5)
        np.testing.assert_allclose(logp[row], ref[np.arange(6), cont[row]], atol=5e-5)
    squeezed, _ = Generator(model, capacity=CAPACITY, policy=parse_policy("snapkv:0:obs_window=8")).score(PROMPTS, cont)
    np.testing.assert_allclose(squeezed, logp, atol=1e-5)
    evicting, _ = Generator(model, capacity=CAPACITY, policy=parse_policy("h2o:0.5:every=1")).score(PROMPTS, cont)
    assert np.isfinite(evicting).all() and not np.allclose(evicting, logp, atol=1e-3)


def test_h2o_normalize_divides_by_the_queries_that_saw_each_key():
    stat = jnp.asarray([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    pos = jnp.asarray([[0, 1, 2, 3, -1]])
    cache = KVCache(k=jnp.zeros((1, 1, 5, 2)), v=jnp.zeros((1, 1, 5, 2)), pos=pos, length=jnp.array([4]))
    last = jnp.array([3])
    np.testing.assert_allclose(score(Stage("h2o", ratio=0.5), cache, stat, last), stat)
    got = score(Stage.of("h2o", ratio=0.5, normalize=True), cache, stat, last)
    np.testing.assert_allclose(got[0, 0, :4], [4 / 4, 3 / 3, 2 / 2, 1 / 1])


@settings(max_examples=6, deadline=None)  # every example compiles new shapes
@given(
    K=st.sampled_from([1, 2, 4]),
    lengths=st.lists(st.integers(6, 30), min_size=1, max_size=3),
    kept=st.floats(0.3, 1.0),
    method=st.sampled_from(
        [
            "streaming",
            "keynorm",
            "keynorm:allocator=adakv",
            "keynorm:allocator=pyramid",
            "quest:page_size=4",
            "streaming:window=2,sinks=1+keynorm:window=2",
        ]
    ),
    seed=st.integers(0, 100),
)
def test_compressed_bytes_and_protected_tokens_over_random_shapes(K, lengths, kept, method, seed):
    """compress_caches on random caches (no model): measured bytes == analytic, every row keeps its
    budget, and the sinks and windows of the last stage survive."""
    from kvjax.compress import compress_caches, compressible
    from kvjax.config import load_config

    cfg = load_config("gqa", ["model.n_layers=2", f"model.attention.n_kv_heads={K}"]).model
    L = np.array(lengths)
    ratio = round(1 - kept, 3)
    text = "+".join(
        f"{part.split(':')[0]}:{ratio}" + (f":{part.split(':', 1)[1]}" if ":" in part else "")
        for part in method.split("+")
    )
    try:
        policy = parse_policy(text)
        plans = plan_stages(cfg, policy.stages, L, headroom=2)
    except ConfigError:
        return  # a budget below sinks + window: refused before compute (tested above)
    S = int(L.max()) + 2
    r = np.random.default_rng(seed)
    caches = tuple(
        c.replace(
            k=jnp.asarray(r.normal(size=c.k.shape), jnp.float32),
            v=jnp.asarray(r.normal(size=c.v.shape), jnp.float32),
            pos=jnp.asarray(np.where(np.arange(S)[None] < L[:, None], np.arange(S)[None], -1), jnp.int32),
            length=jnp.asarray(L, jnp.int32),
        )
        for c in init_caches(cfg, len(L), S)
    )
    compress = jax.jit(compress_caches, static_argnums=(2, 5))
    out, _ = compress(
        caches,
        (None,) * 2,
        tuple(p.static for p in plans),
        tuple(p.arrays for p in plans),
        jnp.asarray(L - 1),
        compressible(cfg),
    )
    assert caches_nbytes(out) == compressed_cache_bytes(cfg, plans, len(L), S)
    last = policy.stages[-1]
    for j, cache in enumerate(out):
        if isinstance(cache, QuestKVCache):
            continue
        for (b, h), kept_pos in _positions_by_head(cache).items():
            count = plans[-1].counts[j][b]
            assert isinstance(cache, PooledKVCache) or len(kept_pos) == count
            window = last.n_window(int(count))
            must = set(range(min(last.n_sinks, L[b]))) | set(range(L[b] - window, L[b]))
            assert must <= set(kept_pos)


@pytest.mark.parametrize(
    "policy", ["snapkv:0.5", "h2o:0.5:allocator=pyramid", "tova:0.5:allocator=adakv", "kivi:2:group=8,residual=8"]
)
def test_on_local_and_global_layers_policies_compress_the_global_ones_with_exact_bytes(make_model, policy):
    """On a model whose local layers keep rings, a policy compresses the global layers only (the rings'
    memory is capped already): the rings come out as the full prefill left them, and the caches' bytes
    equal the analytic bytes."""
    cfg, model = make_model("gqa", *GEMMA_LIKE)
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy))
    tokens, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(tokens, lengths, NEW)
    _, full = Generator(model, capacity=CAPACITY).prefill(tokens, lengths)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    for kind, got, want in zip(cfg.mixers, caches, full):
        if kind == "local":
            jax.tree.map(np.testing.assert_array_equal, got, want)
        else:
            assert caches_nbytes([got]) < caches_nbytes([want])


def test_local_true_compresses_the_rings_to_tokens_inside_their_window(make_model):
    """`local` on the first stage: a budget that keeps every token still in the window decodes as the
    uncompressed model does (rings become position-masked caches, the window masks what ages out); a
    real budget keeps that many of the in-window tokens in each local layer, with exact bytes, and greedy
    decoding through it scores its own tokens as teacher forcing through the same cache does."""
    cfg, model = make_model("gqa", *GEMMA_LIKE)  # windows of 8 tokens; prompts of 40 and 29
    continuation = [[3, 8, 1, 7, 7, 2]] * 2
    full = Generator(model, capacity=CAPACITY).score(PROMPTS, continuation)[0]
    whole = Generator(model, capacity=CAPACITY, policy=parse_policy("snapkv:0:local,obs_window=4"))
    np.testing.assert_allclose(whole.score(PROMPTS, continuation)[0], full, atol=2e-5)

    gen = Generator(model, capacity=CAPACITY, policy=parse_policy("snapkv:0.3:local,obs_window=2"))
    padded, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(padded, lengths, NEW)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    for kind, cache in zip(cfg.mixers, caches):
        for (b, _), kept in _positions_by_head(cache).items():
            L = int(lengths[b])
            assert len(kept) == int(0.7 * min(L, 7) if kind == "local" else 0.7 * L + 1e-9), (kind, b, kept)
            assert kind != "local" or min(kept) > L - 8  # only what the next query still sees
    # SnapKV's choice in a ring: the window, then the best pooled scores of the observed attention over
    # the positions still in the window, pooled in position order (not across the ring's wrap)
    positions = jnp.where(np.arange(padded.shape[1])[None] < lengths[:, None], np.arange(padded.shape[1])[None], -1)
    obs = jnp.asarray(lengths[:, None] - 2 + np.arange(2)[None], jnp.int32)
    stages = gen.policy.stages
    _, _, observed = model.observe(
        jnp.asarray(padded), positions, init_caches(cfg, 2, CAPACITY, fresh=True), obs, observe_fn(stages), rings=True
    )
    for j, kind in enumerate(cfg.mixers):
        for b in range(2 if kind == "local" else 0):
            L, stat = int(lengths[b]), np.asarray(observed[j][0][b])  # [K, T]
            live = (np.arange(stat.shape[-1]) > L - 8) & (np.arange(stat.shape[-1]) < L - 2)
            scores = np.asarray(pool(jnp.asarray(np.where(live, stat, 0))[None], 5, "avg"))[0]
            for h, kept in enumerate(_positions_by_head(caches[j])[b, h] for h in range(stat.shape[0])):
                best = np.argsort(np.where(live, scores[h], -np.inf))[-2:].tolist()  # 4 kept: 2 + the window
                assert kept == sorted([*best, L - 2, L - 1]), (j, b, h, kept, best)
    out = gen(PROMPTS, GREEDY)
    forced = gen.score(PROMPTS, out.tokens.tolist())[0]
    np.testing.assert_allclose(forced, out.logprobs, atol=2e-5)
    uncompressed = Generator(model, capacity=CAPACITY).score(PROMPTS, out.tokens.tolist())[0]
    assert np.abs(forced - uncompressed).max() > 1e-3  # the budget did cut something that mattered


@pytest.mark.parametrize(
    "policy",
    [
        "snapkv:0.3:local,obs_window=2",
        "h2o:0.5:local,every=6",
        "scissorhands:0.5:local,obs_window=2",
        "snapkv:0.5:allocator=pyramid,local,obs_window=2",  # a ring of its layer's own budget
        "tova:0.5:local",
        "snapkv:0.5:allocator=adakv,local,obs_window=2",
        "h2o:0.25:allocator=adakv,local,every=4",
        "tova:0.5:local+int:4",
        "tova:0.5:local+kivi:2:group=4,residual=8",
        "kvquant:2:local,group=4,residual=8",  # its sink and pre-RoPE keys too
        "gear:2:local,group=4,residual=8",  # its error blocks too
        "palu:0.5:local",
        "quest:4:local,page_size=2",
        "think:0.5:local",
    ],
)
def test_a_compressed_ring_stays_within_its_window_while_decoding(make_model, monkeypatch, policy):
    """A ring compressed by token eviction (`local`) keeps decoding in at most W = 8 slots
    (`WindowKVCache`: a new token over the oldest once full), with `every=` between evictions too (where a
    new token's running sum starts at zero, not at the sum of the token whose slot it took), an AdaKV pool
    in at most K W = 16 entries (`WindowPooledKVCache`: a token's K entries over the K oldest), and so does
    one in per-token int codes after it, or in KIVI's blocks of 8 tokens (2 key groups of 4) through its
    residual, a block's codes and key scales landing on the slots its tokens hold (`WindowQuantKVCache`),
    with KVQuant's exact sink while its slot still holds it and GEAR's error factors per block slot; so do
    Palu's latents, Quest's pages (5 of 2 slots, every page W tokens touch, each begun again with fresh key
    bounds) and ThinK's tail of decoded tokens: the same tokens and log-probabilities as the same cache left
    to grow (what it overwrites is out of every later query's window), in fewer bytes, measured equal to
    analytic."""
    from kvjax.cache import Ring
    from kvjax.compress import apply
    from kvjax.compress.methods.base import Target
    from kvjax.compress.think import ThinKCache

    cfg, model = make_model("gqa", *GEMMA_LIKE, "model.n_layers=2")  # a local layer and a global one
    decoding, calibration = DecodingConfig(max_new_tokens=30), np.arange(60).reshape(2, 30) % 50 + 3
    capped = Generator(model, capacity=CAPACITY + 30, policy=parse_policy(policy), calibration=calibration)
    out = capped(PROMPTS, decoding)
    lengths = np.array([len(p) for p in PROMPTS])
    assert caches_nbytes(out.caches) == capped.cache_bytes(lengths, 30)
    local = [c for kind, c in zip(cfg.mixers, out.caches) if kind == "local"]
    rings = [c.tail if isinstance(c, ThinKCache) else c for c in local]
    most = 2 * 8 if "adakv" in policy else 10 if "quest" in policy else 8
    assert rings and all(isinstance(c, Ring) and c.capacity <= most for c in rings)
    assert all(int(c.length.min()) > c.capacity for c in rings) or "every" in policy  # it did wrap
    assert all(getattr(c, "spec", None) is None or c.spec.rope_theta == 100 for c in local)  # the window's own base
    # what it was: a plain cache with room for all (one slot more: compiled anew, under the patches)
    monkeypatch.setattr(apply, "wraps", lambda stage: False)
    monkeypatch.setattr(Target, "capped", staticmethod(lambda slots, most: slots))
    grown = Generator(model, capacity=CAPACITY + 31, policy=parse_policy(policy), calibration=calibration)
    want = grown(PROMPTS, decoding)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=2e-5)
    assert caches_nbytes(out.caches) < caches_nbytes(want.caches)


@pytest.mark.parametrize(
    "policy",
    [
        "quest:1000:local,page_size=4",  # reading at least the window reads every page of a ring
        "think:0.0:local",
        "palu:0.0:local",  # full rank: the rings' calibrated bases span their keys and values
    ],
)
def test_local_true_runs_quantizers_selectors_and_encoders_with_exact_bytes(make_model, policy):
    """`local` with the stages that re-encode a cache rather than choose its tokens: the rings' bytes
    are analytic, and a setting that loses nothing scores as the uncompressed model does."""
    cfg, model = make_model("gqa", *GEMMA_LIKE)
    calibration = np.arange(60).reshape(2, 30) % 50 + 3
    gen = Generator(model, capacity=CAPACITY, policy=parse_policy(policy), calibration=calibration)
    padded, lengths = gen.pad(PROMPTS, NEW)
    _, caches, _ = gen.prefill_compressed(padded, lengths, NEW)
    assert not any(isinstance(c, RingKVCache) for c in caches)
    assert caches_nbytes(caches) == compressed_cache_bytes(cfg, gen.compression_plan(lengths, NEW), 2, CAPACITY)
    for kind, cache in zip(cfg.mixers, caches):
        spec = getattr(cache, "spec", None)
        assert spec is None or spec.rope_theta == cfg.attention_for(kind).rope_theta
    continuation = [[3, 8, 1, 7, 7, 2]] * 2
    full = Generator(model, capacity=CAPACITY).score(PROMPTS, continuation)[0]
    np.testing.assert_allclose(gen.score(PROMPTS, continuation)[0], full, atol=2e-5)


@pytest.mark.parametrize(
    "model, policy, error",
    [
        ((), "snapkv:0.5:local", "local=true compresses sliding-window rings, and 'gqa' has none"),
        (GEMMA_LIKE, "snapkv:0.5+streaming:0.5:local", "local= goes on the first stage"),
        (GEMMA_LIKE, "minicache:0.5:local", "local=true does not apply: it merges pairs"),
        (GEMMA_LIKE, "d2o:0.5:local", "local=true does not apply: its layer budgets"),
        (GEMMA_LIKE, "kivi:2:local,group=4,residual=16", r"residual=16 must be at most the sliding window \(8"),
    ],
)
def test_local_true_is_refused_where_it_cannot_apply(make_model, model, policy, error):
    cfg, m = make_model("gqa", *model)
    with pytest.raises(ConfigError, match=error):
        Generator(m, capacity=CAPACITY, policy=parse_policy(policy))

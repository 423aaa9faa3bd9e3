"""Paged KV memory: a decoder over scattered pages computes what it computes over a dense cache; the
allocator never leaks or double-books a page, copy-on-write isolates sequences, full pages are reused
through the prefix cache, and impossible requests are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.ops import attention
from kvjax.page_pool import NULL_PAGE, PagePool, PoolExhausted
from kvjax.paged import PagedKVCache, pool_is_cheaper
from kvjax.plan import init_caches
from kvjax.quant.packing import pack

PS, PAGES, WIDTH = 4, 24, 8  # page size, pool pages, table columns


def _paged_caches(cfg, batch):
    att = cfg.attention
    n = len(set(cfg.kv_source))
    return tuple(
        PagedKVCache.init(PAGES, PS, batch, WIDTH, att.n_kv_heads, att.head_dim, jnp.float32) for _ in range(n)
    )


def _with_tables(caches, pool, seqs):
    table = jnp.asarray(pool.table(seqs, WIDTH))
    length = jnp.asarray([pool.lengths[s] for s in seqs], jnp.int32)
    return tuple(c.replace(table=table, length=length) for c in caches)


def test_a_decoder_over_scattered_pages_equals_the_dense_cache(make_model):
    cfg, model = make_model("gqa", "model.n_layers=2")
    pool = PagePool(PAGES, PS)
    pool.admit("junk", np.arange(9)), pool.reserve("junk", 9), pool.release("junk")  # scramble the free order
    rng = np.random.default_rng(0)
    lengths, T, new = np.array([13, 7]), 13, 5
    tokens = rng.integers(0, cfg.vocab_size, (2, T + new))
    pos = np.where(np.arange(T)[None] < lengths[:, None], np.arange(T)[None], -1)
    step = jax.jit(lambda t, p, c: model(t, p, c))
    dense_logits, dense = step(jnp.asarray(tokens[:, :T]), jnp.asarray(pos), init_caches(cfg, 2, 32))
    for seq, n in zip("ab", lengths):
        pool.admit(seq, tokens[0 if seq == "a" else 1, :n]), pool.reserve(seq, n), pool.advance(seq, n)
    caches = _with_tables(_paged_caches(cfg, 2), pool, "ab")
    caches = tuple(c.replace(length=jnp.zeros(2, jnp.int32)) for c in caches)  # the prefill writes from 0
    logits, caches = step(jnp.asarray(tokens[:, :T]), jnp.asarray(pos), caches)
    np.testing.assert_allclose(logits, dense_logits, atol=1e-5)
    for t in range(new):
        nxt = jnp.asarray(tokens[np.arange(2), lengths + t][:, None])
        p = jnp.asarray((lengths + t)[:, None], jnp.int32)
        dense_logits, dense = step(nxt, p, dense)
        for seq in "ab":
            pool.reserve(seq, 1)
        caches = _with_tables(caches, pool, "ab")
        logits, caches = step(nxt, p, caches)
        for seq in "ab":
            pool.advance(seq, 1)
        np.testing.assert_allclose(logits, dense_logits, atol=1e-5, err_msg=f"decode step {t}")
    assert sorted({int(x) for x in np.asarray(caches[0].table).ravel()} - {NULL_PAGE}) == sorted(
        pool.tables["a"] + pool.tables["b"]
    )


def test_copy_on_write_never_alters_the_other_sequence():
    pool = PagePool(8, PS)
    cache = PagedKVCache.init(8, PS, 2, 3, 1, 2, jnp.float32)
    pool.admit("p", np.arange(6)), pool.reserve("p", 6), pool.advance("p", 6)  # 1.5 pages
    cache = cache.replace(table=jnp.asarray(pool.table(["p", None], 3)), length=jnp.zeros(2, jnp.int32))
    ones = jnp.ones((2, 6, 1, 2))
    cache, _ = cache.update(ones, ones, jnp.asarray([np.arange(6), np.full(6, -1)]))
    pool.fork("p", "c")
    copies = pool.reserve("c", 1)  # the child writes into the shared partial page: it gets a copy
    assert len(copies) == 1 and copies[0][0] == pool.tables["p"][1] and pool.tables["c"][1] != pool.tables["p"][1]
    cache = cache.copy_pages(copies).replace(
        table=jnp.asarray(pool.table(["p", "c"], 3)), length=jnp.asarray([6, 6], jnp.int32)
    )
    twos = jnp.full((2, 1, 1, 2), 2.0)
    cache, view = cache.update(twos, twos, jnp.asarray([[-1], [6]]))
    np.testing.assert_array_equal(view.k[0, 0, :6], 1.0)  # the parent still reads its own tokens
    np.testing.assert_array_equal(view.pos[0], [0, 1, 2, 3, 4, 5] + [-1] * 6)
    np.testing.assert_array_equal(view.k[1, 0, :7, 0], [1, 1, 1, 1, 1, 1, 2])


def test_full_pages_are_reused_through_the_prefix_cache():
    pool = PagePool(16, PS)
    prompt = np.arange(11)  # 2 full pages + 3 tokens
    assert pool.admit("a", prompt) == 0
    pool.reserve("a", 11), pool.advance("a", 11), pool.register("a", prompt)
    assert pool.admit("b", np.concatenate([prompt[:8], [99, 98]])) == 8  # both full pages hit
    assert pool.tables["b"] == pool.tables["a"][:2] and pool.refs[pool.tables["a"][0]] == 2
    assert pool.admit("c", prompt[:8]) == 4  # at most n - 1 tokens: the last page must be computed
    pool.release("a"), pool.release("b"), pool.release("c")
    assert pool.used_pages == 0 and pool.admit("d", prompt) == 8  # unreferenced cached pages still hit
    assert (pool.hits, pool.misses) == (2 + 1 + 2, 3 + 1 + 1 + 1)
    # a lookup of at most `limit` tokens (a compressed prompt's start): hits below it, pages never required
    assert pool.admit("e", prompt, limit=7) == 4 and pool.admit("f", np.arange(99), limit=20) == 8


def test_requests_the_pool_cannot_hold_are_refused():
    pool = PagePool(5, PS)
    with pytest.raises(ValueError, match="needs 5 pages of 4; the whole pool has 4"):
        pool.admit("big", np.arange(17))
    pool.admit("a", np.arange(12)), pool.reserve("a", 12)
    pool.admit("b", np.arange(8))
    with pytest.raises(PoolExhausted, match="needs 2 pages; 1 are free"):
        pool.reserve("b", 8)
    assert pool.tables["b"] == [] and pool.used_pages == 3  # nothing was taken


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "fork", "release"]), st.integers(0, 5), st.integers(1, 9)),
        max_size=40,
    )
)
def test_no_page_is_ever_leaked_or_double_booked(ops):
    pool, history = PagePool(12, PS), {}
    for op, seq, n in ops:
        try:
            if op == "admit" and seq not in pool.tables:
                prompt = np.arange(n) % 3
                pool.admit(seq, prompt)
                history[seq] = list(prompt[: pool.lengths[seq]])
            elif op == "grow" and seq in pool.tables:
                pool.reserve(seq, n)
                pool.advance(seq, n)
                history[seq] += [len(history[seq]) % 3] * n
                pool.register(seq, history[seq])
            elif op == "fork" and seq in pool.tables and seq + 10 not in pool.tables:
                pool.fork(seq, seq + 10)
                history[seq + 10] = list(history[seq])
            elif op == "release" and seq in pool.tables:
                pool.release(seq)
        except PoolExhausted:
            pass
        held = np.zeros(12, np.int64)
        for pages in pool.tables.values():
            np.add.at(held, pages, 1)
        assert (held == pool.refs).all() and NULL_PAGE not in pool.free and pool.refs[NULL_PAGE] == 0
        assert all((pool.refs[p] == 0) == (p in pool.free) for p in range(1, 12))  # free iff unreferenced
        assert all(
            len(pages) == pool.pages_for(pool.lengths[s]) or len(pages) > pool.pages_for(pool.lengths[s])
            for s, pages in pool.tables.items()
        )
    for seq in list(pool.tables):
        pool.release(seq)
    assert pool.used_pages == 0 and len(pool.free) == 11  # every page back


def test_a_reused_page_shows_nothing_of_its_previous_owner():
    """Pages are not cleared when freed: a new owner's view masks every slot past its own length."""
    pool = PagePool(3, PS)
    cache = PagedKVCache.init(3, PS, 1, 2, 1, 2, jnp.float32)
    pool.admit("old", np.arange(8)), pool.reserve("old", 8), pool.advance("old", 8)
    cache = cache.replace(table=jnp.asarray(pool.table(["old"], 2)), length=jnp.zeros(1, jnp.int32))
    cache, _ = cache.update(jnp.ones((1, 8, 1, 2)), jnp.ones((1, 8, 1, 2)), jnp.arange(8)[None])
    pool.release("old")
    pool.admit("new", np.arange(2)), pool.reserve("new", 2), pool.advance("new", 2)
    assert pool.tables["new"][0] in (1, 2)  # one of the old pages
    cache = cache.replace(table=jnp.asarray(pool.table(["new"], 2)), length=jnp.zeros(1, jnp.int32))
    cache, view = cache.update(jnp.zeros((1, 2, 1, 2)), jnp.zeros((1, 2, 1, 2)), jnp.asarray([[0, 1]]))
    np.testing.assert_array_equal(view.pos[0], [0, 1] + [-1] * 6)


def _scattered(rng, K, per_head=False, int8=False):
    """A pool of 12 pages read by three rows: row 0 holds 10 tokens in pages 3, 7, 1; row 1 19 tokens in
    5 pages, sharing page 7 with row 0 (a prefix hit); row 2 is padding. Every slot of the pool has
    contents and a position, so a slot no row owns, or past a row's length, would be seen if not masked."""
    P = 12
    pos = np.stack([rng.permutation(P * PS).reshape(P, PS) % 24 for _ in range(K if per_head else 1)], 1)
    if int8:
        codes = {n: jnp.asarray(pack(jnp.asarray(rng.integers(0, 256, (P, K, PS, 8))), 8)) for n in "kv"}
        scales = {f"{n}_scale": jnp.asarray(rng.uniform(0.01, 0.1, (P, K, PS, 1)), jnp.float32) for n in "kv"}
        arrays = codes | scales
    else:
        arrays = {n: jnp.asarray(rng.normal(size=(P, K, PS, 8)), jnp.float32) for n in "kv"}
    table = jnp.asarray([[3, 7, 1, 0, 0], [5, 7, 9, 11, 4], [0, 0, 0, 0, 0]], jnp.int32)
    length = jnp.asarray([10, 19, 0], jnp.int32)
    return PagedKVCache(pos=jnp.asarray(pos, jnp.int32), table=table, length=length, bits=8 if int8 else None, **arrays)


@pytest.mark.parametrize(
    "N, K, window, per_head, int8, softcap",
    [
        (4, 2, None, False, False, None),
        (4, 1, 6, False, False, 0.5),  # Gemma 2's soft-capped logits
        (2, 2, None, True, False, None),
        (6, 2, None, False, True, None),
    ],
)
def test_attention_over_the_whole_pool_equals_attention_over_the_gathered_pages(N, K, window, per_head, int8, softcap):
    """`attend_pool` (the engine's XLA decode path once tables span the pool) == the op over the view."""
    rng = np.random.default_rng(0)
    cache = _scattered(rng, K, per_head, int8)
    q = jnp.asarray(rng.normal(size=(3, 1, N, 8)), jnp.float32)
    q_pos = jnp.asarray([[23], [21], [-1]], jnp.int32)
    args = dict(window=window, scale=0.3, softcap=softcap)
    view = cache.view()
    out = cache.attend_pool(q, q_pos, **args)
    np.testing.assert_allclose(out, attention(q, view.k, view.v, q_pos, view.pos, **args), atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # the padding row sees no key
    shorter = cache.replace(length=cache.length.at[1].set(13))  # the length bounds what a row reads
    cut = shorter.attend_pool(q, q_pos, **args)
    short = shorter.view()
    np.testing.assert_allclose(cut, attention(q, short.k, short.v, q_pos, short.pos, **args), atol=1e-5)
    assert window is not None or not np.allclose(cut[1], out[1])


def test_the_decode_path_follows_the_measured_costs():
    """`pool_is_cheaper` takes the pool where `scripts/bench_pool_switch.py` measured it faster (SmolLM2's chat
    workload: 16 rows of 20 columns over 74 pages, 2.4x) and gathers where the pool was slower (the demo's
    chat and long generations: 31 rows of 36 over 1,090 pages, 0.1x; 32 of 132 over 1,934, 0.4x), and
    wherever the pool holds more pages than the tables (R x M < P), however cheap its logits."""
    assert pool_is_cheaper(16, 20, 74, n_heads=9, n_kv_heads=3, head_dim=64)
    assert not pool_is_cheaper(31, 36, 1090, n_heads=8, n_kv_heads=2, head_dim=16)
    assert not pool_is_cheaper(32, 132, 1934, n_heads=8, n_kv_heads=2, head_dim=16)
    assert not pool_is_cheaper(1, 8, 9, n_heads=8, n_kv_heads=1, head_dim=64)


def test_a_mixed_step_computes_what_the_decode_step_and_the_chunk_compute_apart(make_model):
    """Two decoding rows and a chunk of a third row's prompt in one pass (`chunk_row`): the same logits
    and the same pages as the decode step of the two rows, then the chunk alone."""
    cfg, model = make_model("gqa", "model.n_layers=2")
    rng = np.random.default_rng(1)
    pool = PagePool(PAGES, PS)
    prompts = {s: rng.integers(0, cfg.vocab_size, n) for s, n in zip("abc", (9, 6, 11))}
    caches = _paged_caches(cfg, 3)
    for s in "abc":  # a and b wholly prefilled, c's first 3 tokens (as if from the prefix cache)
        n = len(prompts[s]) if s != "c" else 3
        pool.admit(s), pool.reserve(s, len(prompts[s]) + 1)
        caches = _with_tables(caches, pool, [s])
        caches = tuple(c.replace(length=jnp.zeros(1, jnp.int32)) for c in caches)
        _, caches = model(jnp.asarray(prompts[s][None, :n]), jnp.arange(n)[None], caches)
        pool.advance(s, n)
    step = jax.jit(lambda t, p, c: model.hidden(t, p, c))
    nxt = rng.integers(0, cfg.vocab_size, 2)
    chunk = prompts["c"][3:]
    # apart: the decode rows [2,1], then the chunk [1,8]
    apart = _with_tables(caches, pool, "ab")
    rows_h, apart = step(jnp.asarray(nxt[:, None]), jnp.asarray([[9], [6]]), apart)
    apart = tuple(
        c.replace(table=jnp.asarray(pool.table(["c"], WIDTH)), length=jnp.asarray([3], jnp.int32)) for c in apart
    )
    chunk_h, apart = step(jnp.asarray(chunk[None]), jnp.arange(3, 11)[None], apart)
    # together: rows a, b, c (c feeds no decode token), then c's chunk
    mixed = tuple(c.replace(chunk_row=jnp.int32(2)) for c in _with_tables(caches, pool, "abc"))
    ids = jnp.asarray(np.concatenate([nxt, [0], chunk])[None])
    pos = jnp.asarray(np.concatenate([[9, 6, -1], np.arange(3, 11)])[None])
    hidden, mixed = step(ids, pos, mixed)
    np.testing.assert_allclose(hidden[0, :2], rows_h[:, 0], atol=1e-5)
    np.testing.assert_allclose(hidden[0, 3:], chunk_h[0], atol=1e-5)
    np.testing.assert_array_equal(mixed[0].length, [10, 7, 11])
    for a, b in zip(apart, mixed):
        np.testing.assert_allclose(b.k, a.k, atol=1e-6)
        np.testing.assert_array_equal(b.pos, a.pos)

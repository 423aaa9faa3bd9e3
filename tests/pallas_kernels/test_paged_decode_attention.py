"""Paged decode attention in interpret mode (both designs) equals dense attention over the same keys, a
decoder under impl=pallas reads its paged cache through the kernel, and the kernel lowers for TPU and GPU."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.paged import PagedKVCache
from kvjax.pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_reference
from tests.pallas_kernels.lowering import BACKEND, TARGETS, assert_lowers

P = 12  # pool pages
PS = 16 if BACKEND == "triton" else 4  # page size: Triton's dot operands need 16 rows


def _pages(seed, K=2, N=4, H=8, Hv=None, per_head=False, ps=PS):
    """Three rows over a shared pool: row 0 holds 10 tokens in pages 3, 7, 1; row 1 holds 19 in 5 pages,
    sharing page 7 with row 0 (a prefix-cache hit); row 2 is padding (length 0, null pages). Every
    pool slot has a position, so slots past a row's length (old tokens of a reused page) would be
    visible if the length did not mask them. `per_head`: positions per KV head (after head-wise eviction)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(3, K, N // K, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(P, K, ps, Hv or H)), jnp.float32)
    pos = jnp.asarray(
        np.stack([rng.permutation(P * ps).reshape(P, ps) % 24 for _ in range(K if per_head else 1)], 1), jnp.int32
    )
    table = jnp.asarray([[3, 7, 1, 0, 0], [5, 7, 9, 11, 4], [0, 0, 0, 0, 0]], jnp.int32)
    return q, k, v, pos, table, jnp.asarray([10, 19, 0], jnp.int32), jnp.asarray([23, 21, -1], jnp.int32)


@pytest.mark.parametrize(
    "design, N, K, window, per_head",
    [
        ("gather", 4, 2, None, False),
        ("gather", 4, 1, 6, False),
        ("gather", 2, 2, None, True),
        ("grid", 4, 2, 6, False),
        ("grid", 2, 2, None, True),
    ],
)
def test_interpret_equals_dense_attention_over_the_gathered_pages(design, N, K, window, per_head):
    """GQA; MQA with a window; MHA with positions per head (the grid design: GQA with a window, MHA)."""
    if design == "grid" and BACKEND == "triton":
        pytest.skip("the grid design is TPU's (scalar prefetch)")
    q, k, v, pos, table, length, q_pos = _pages(0, K=K, N=N, per_head=per_head)
    kw = dict(scale=0.3, window=window)
    out = paged_decode_attention(q, k, v, pos, table, length, q_pos, backend=BACKEND, design=design, **kw)
    np.testing.assert_allclose(out, paged_decode_reference(q, k, v, pos, table, length, q_pos, **kw), atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # the padding row sees no key
    shorter = length.at[0].set(9)  # the length bounds what a row reads
    cut = paged_decode_attention(q, k, v, pos, table, shorter, q_pos, backend=BACKEND, design=design, **kw)
    np.testing.assert_allclose(cut, paged_decode_reference(q, k, v, pos, table, shorter, q_pos, **kw), atol=1e-5)
    assert window is not None or not np.allclose(cut[0], out[0])


def test_many_splits_and_wider_values():
    """40 table columns: the gather design splits them over programs and merges the splits."""
    q, k, v, pos, _, _, q_pos = _pages(1, Hv=12)
    table = jnp.asarray(np.random.default_rng(1).integers(1, P, size=(3, 40)), jnp.int32)
    length = jnp.asarray([150, 37, 0], jnp.int32)
    out = paged_decode_attention(q, k, v, pos, table, length, q_pos + 30, scale=0.3, backend=BACKEND)
    ref = paged_decode_reference(q, k, v, pos, table, length, q_pos + 30, scale=0.3)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_the_cache_view_and_the_kernel_agree():
    """`PagedKVCache.view()` (the XLA path's gathered keys) through kvjax.ops equals the kernel."""
    from kvjax.ops import attention

    q, k, v, pos, table, length, q_pos = _pages(2, per_head=True)
    cache = PagedKVCache(k=k, v=v, pos=pos, table=table, length=length)
    view = cache.view()
    B, K, G, H = q.shape
    q4 = q.reshape(B, 1, K * G, H)
    xla = attention(q4, view.k, view.v, q_pos[:, None], view.pos, scale=0.3)
    kernel = attention(q4, view.k, view.v, q_pos[:, None], view.pos, scale=0.3, impl="pallas", paged=view.paged)
    np.testing.assert_allclose(kernel, xla, atol=1e-5)


def test_a_decoder_under_pallas_decodes_through_the_paged_kernel(make_model, monkeypatch):
    """The engine's decode step on a model with impl=pallas calls the paged kernel and gets the XLA
    model's tokens and log-probabilities."""
    import kvjax.ops
    from kvjax import DecodingConfig
    from kvjax.engine import Engine, Request

    calls = []
    monkeypatch.setattr(
        kvjax.ops, "paged_decode_attention", lambda *a, **kw: calls.append(1) or paged_decode_attention(*a, **kw)
    )
    _, xla = make_model("gqa", "model.n_layers=1")
    _, pallas = make_model("gqa", "model.n_layers=1", "model.attention.impl=pallas")
    requests = [
        Request((5, 9, 2, 7, 1, 3), DecodingConfig(max_new_tokens=3)),
        Request((4, 8), DecodingConfig(max_new_tokens=4)),
    ]
    want = Engine(xla, n_pages=8, page_size=PS, slots=2, chunk=8).run(requests)
    got = Engine(pallas, n_pages=8, page_size=PS, slots=2, chunk=8).run(requests)
    assert calls  # traced into the decode step
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bad_arguments_are_refused():
    q, k, v, pos, table, length, q_pos = _pages(3, ps=4)
    with pytest.raises(ValueError, match="design='ring' must be one of"):
        paged_decode_attention(q, k, v, pos, table, length, q_pos, scale=1.0, backend=BACKEND, design="ring")
    with pytest.raises(ValueError, match=r"page_size=4: the Triton paged kernel needs a power of two >= 16"):
        paged_decode_attention(q, k, v, pos, table, length, q_pos, scale=1.0, backend="triton")
    with pytest.raises(ValueError, match=r"design='grid' needs scalar prefetch"):
        paged_decode_attention(q, k, v, pos, table, length, q_pos, scale=1.0, backend="triton", design="grid")
    with pytest.raises(ValueError, match=r"q \(3, 2, 2, 8\) must be \[B,K=3"):
        paged_decode_attention(q, k[:, :1].repeat(3, 1), v, pos, table, length, q_pos, scale=1.0, backend=BACKEND)


@TARGETS
def test_lowers(platform, backend, marker):
    """SmolLM2's decode shape (3 KV heads of 3 queries, head dim 64) over 16-token bf16 pages."""
    fn = functools.partial(paged_decode_attention, scale=0.125, backend=backend)
    shapes = [
        ((2, 3, 3, 64), jnp.bfloat16),
        ((40, 3, 16, 64), jnp.bfloat16),
        ((40, 3, 16, 64), jnp.bfloat16),
        ((40, 16), jnp.int32),
        ((2, 9), jnp.int32),
        ((2,), jnp.int32),
        ((2,), jnp.int32),
    ]
    assert_lowers(fn, shapes, platform, marker, ("kvjax_paged_decode_attention",))

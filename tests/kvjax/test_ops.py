"""The attention op against a plain per-head loop written independently of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.ops import attend, attention, attention_probs, causal_blocks, decode_block, key_block, key_blocks


def loop_reference(q, k, v, q_pos, k_pos, window):
    """Attention one (batch, head, query) at a time, query head n using kv head n // (N/K)."""
    B, T, N, H = q.shape
    K, S = k.shape[1:3]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            for t in range(T):
                seen = [
                    s
                    for s in range(S)
                    if 0 <= k_pos[b, s] <= q_pos[b, t] and (window is None or q_pos[b, t] - k_pos[b, s] < window)
                ]
                if not seen:
                    continue
                logits = np.array([q[b, t, n] @ k[b, kv, s] for s in seen]) / np.sqrt(H)
                p = np.exp(logits - logits.max())
                out[b, t, n] = (p / p.sum()) @ np.stack([v[b, kv, s] for s in seen])
    return out


def random_inputs(B=2, T=5, S=9, N=4, K=2, H=8, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (r.normal(size=s).astype(np.float32) for s in [(B, T, N, H), (B, K, S, H), (B, K, S, H)])
    # Keys in shuffled slot order with some empty (-1) slots; queries at the last positions.
    k_pos = np.stack([r.permutation(np.where(np.arange(S) < S - 2, np.arange(S), -1)) for _ in range(B)])
    q_pos = np.tile(np.arange(S - 2 - T, S - 2), (B, 1))
    return q, k, v, q_pos.astype(np.int32), k_pos.astype(np.int32)


@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_attention_matches_loop_reference(N, K, window):
    q, k, v, q_pos, k_pos = random_inputs(N=N, K=K)
    got = attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)), window=window)
    np.testing.assert_allclose(got, loop_reference(q, k, v, q_pos, k_pos, window), atol=1e-5)


@pytest.mark.parametrize("N, K", [(4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_blocked_decode_matches_loop_reference(N, K, window):
    """One query per row takes the blocked path (64 slots -> 2 blocks of 32); a padding query row
    still outputs zeros."""
    assert (decode_block(64), decode_block(2048), decode_block(2058), decode_block(8202)) == (32, 128, 98, None)
    assert decode_block(48) is None and decode_block(2 * 131) == 131
    q, k, v, q_pos, k_pos = random_inputs(T=1, S=64, N=N, K=K)
    q_pos[1, 0] = -1
    got = attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)), window=window)
    np.testing.assert_allclose(got, loop_reference(q, k, v, q_pos, k_pos, window), atol=1e-5)
    assert np.all(np.asarray(got)[1] == 0)


@pytest.mark.parametrize("window", [None, 12])
def test_a_chunk_over_its_own_keys_in_causal_blocks(window):
    """`fresh=T` (a prefill into an empty cache): 40 queries over their own keys at the front of a
    56-slot cache (row 1 padded after 27 tokens), query blocks of 16 that skip hidden key blocks: equal
    to the per-head loop, gradients included, and to attention over every slot."""
    B, T, S, N, K, H = 2, 40, 56, 4, 2, 8
    r = np.random.default_rng(3)
    q, k, v = (r.normal(size=s).astype(np.float32) for s in [(B, T, N, H), (B, K, S, H), (B, K, S, H)])
    pos = np.stack([np.arange(T), np.where(np.arange(T) < 27, np.arange(T), -1)]).astype(np.int32)
    k_pos = np.concatenate([pos, np.full((B, S - T), -1, np.int32)], axis=1)
    want = loop_reference(q, k, v, pos, k_pos, window)
    args = tuple(map(jnp.asarray, (q, k, v, pos, k_pos)))
    np.testing.assert_allclose(attention(*args, window=window, fresh=T), want, atol=1e-5)

    def blocked(q, k, v):
        return causal_blocks(q, k[:, :, :T], v[:, :, :T], args[3], args[4][:, :T], window, None, "xla", 16)

    np.testing.assert_allclose(blocked(*args[:3]), want, atol=1e-5)
    loss = lambda f: lambda *x: (f(*x) * jnp.sin(jnp.arange(B * T * N * H).reshape(B, T, N, H))).sum()  # noqa: E731
    grads = jax.grad(loss(blocked), argnums=(0, 1, 2))(*args[:3])
    dense = jax.grad(loss(lambda q, k, v: attention(q, k, v, args[3], args[4], window=window)), argnums=(0, 1, 2))(
        *args[:3]
    )
    for got, expected in zip(grads, dense):
        np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("window, softcap, per_head", [(None, None, False), (7, None, False), (None, 5.0, True)])
def test_a_chunk_over_a_long_cache_in_key_blocks(window, softcap, per_head):
    """A chunk of 6 queries (row 1 padded) over 64 slots, 16 keys a block with a running softmax: equal
    to one softmax over every key; the last block (empty slots) and, with a window, blocks out of it are
    skipped without changing a value; a padding query outputs zeros."""
    assert (key_block(1024), key_block(4096), key_block(131072), key_block(1000), key_block(600)) == (
        512,
        2048,
        2048,
        None,
        None,
    )
    q, k, v, q_pos, k_pos = random_inputs(T=6, S=64, N=4, K=2, seed=5)
    k_pos = np.where(np.arange(64) < 48, np.arange(64), -1)[None].repeat(2, 0).astype(np.int32)
    q_pos = np.stack([np.arange(42, 48), np.where(np.arange(6) < 4, np.arange(30, 36), -1)]).astype(np.int32)
    k_pos = np.stack([k_pos, np.where(np.arange(64) % 5 == 0, -1, k_pos)], axis=1) if per_head else k_pos
    args = tuple(map(jnp.asarray, (q, k, v, q_pos, k_pos)))
    dense = attend(attention_probs(*args, window=window, softcap=softcap), args[2])
    got = key_blocks(*args, window, None, 16, softcap)
    np.testing.assert_allclose(got, dense, atol=2e-6)
    assert np.all(np.asarray(got)[1, 4:] == 0)


def test_blocked_decode_with_per_head_positions_matches_dense_path():
    q, k, v, q_pos, k_pos = map(jnp.asarray, random_inputs(T=1, S=64, N=4, K=2))
    per_head = jnp.stack([k_pos, jnp.where(k_pos % 3 == 0, -1, k_pos)], axis=1)  # head 1 lost a third
    dense = attend(attention_probs(q, k, v, q_pos, per_head), v)
    np.testing.assert_allclose(attention(q, k, v, q_pos, per_head), dense, atol=1e-6)


def test_padding_query_is_finite_and_masked_keys_get_no_gradient():
    q, k, v, q_pos, k_pos = random_inputs()
    q_pos[0, 0] = -1  # a padding query sees nothing: it outputs zeros
    out = attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
    assert np.isfinite(np.asarray(out)).all() and np.all(np.asarray(out)[0, 0] == 0)
    grad_v = jax.grad(lambda v: attention(q, k, v, q_pos, k_pos).sum())(jnp.asarray(v))
    assert np.all(np.asarray(grad_v).transpose(0, 2, 1, 3)[k_pos < 0] == 0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"][..., :4]}, "disagree on batch or head_dim"),
        (lambda a: {**a, "q": a["q"][:, :, :3]}, "N=3 must be a multiple of kv heads K=2"),
        (lambda a: {**a, "v": a["v"][:, :, :-1]}, "must be [B,T,N,H]"),
        (lambda a: {**a, "k_pos": a["k_pos"][:, :-1]}, "k_pos (2, 8) must be (2, 9)"),
        (lambda a: {**a, "window": 0}, "window=0 must be > 0"),
        (lambda a: {**a, "impl": "cuda"}, "impl='cuda' must be one of"),
    ],
)
def test_bad_shapes_raise_before_compute(change, message):
    q, k, v, q_pos, k_pos = random_inputs()
    args = change(dict(q=q, k=k, v=v, q_pos=q_pos, k_pos=k_pos))
    with pytest.raises(ValueError) as info:
        attention(**args)
    assert message in str(info.value)

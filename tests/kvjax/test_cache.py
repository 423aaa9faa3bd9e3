import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import KVCache, RingKVCache


def chunk(positions, K=2, H=2):
    """A chunk whose k and v carry their own position in every channel, so slots are easy to read."""
    pos = jnp.asarray(positions, jnp.int32)
    val = jnp.broadcast_to(pos[:, :, None, None], (*pos.shape, K, H)).astype(jnp.float32)
    return val, val + 0.5, pos


def test_kvcache_appends_per_row_and_skips_padding():
    cache = KVCache.init(2, 6, 2, 2, jnp.float32)
    cache, view = cache.update(*chunk([[0, 1, 2], [0, -1, -1]]))
    np.testing.assert_array_equal(cache.length, [3, 1])
    np.testing.assert_array_equal(cache.pos, [[0, 1, 2, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
    cache, view = cache.update(*chunk([[3], [1]]))
    np.testing.assert_array_equal(view.pos, [[0, 1, 2, 3, -1, -1], [0, 1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(view.k[:, 1, :, 0], np.maximum(view.pos, 0))
    np.testing.assert_array_equal(view.v[1, 0, 1], [1.5, 1.5])


def test_ring_keeps_the_last_window_positions():
    ring = RingKVCache.init(1, 4, 2, 2, jnp.float32)
    ring, view = ring.update(*chunk([list(range(10))]))  # chunk longer than the ring
    np.testing.assert_array_equal(view.pos[0, 4:], np.arange(10))  # the chunk attends over all of itself
    np.testing.assert_array_equal(ring.pos[0], [8, 9, 6, 7])  # slot = pos % 4
    np.testing.assert_array_equal(ring.k[0, 0, :, 0], [8, 9, 6, 7])
    ring, view = ring.update(*chunk([[10]]))
    np.testing.assert_array_equal(view.pos[0], [8, 9, 10, 7])
    assert int(ring.length[0]) == 11


def test_ring_chunk_after_partial_fill_and_padding():
    ring = RingKVCache.init(2, 4, 2, 2, jnp.float32)
    ring, _ = ring.update(*chunk([[0, 1, 2], [0, 1, -1]]))
    ring, view = ring.update(*chunk([[3, 4], [2, 3]]))
    np.testing.assert_array_equal(view.pos, [[0, 1, 2, -1, 3, 4], [0, 1, -1, -1, 2, 3]])
    np.testing.assert_array_equal(ring.pos, [[4, 1, 2, 3], [0, 1, 2, 3]])


def test_update_rejects_mismatched_chunks():
    cache = KVCache.init(2, 6, 2, 4, jnp.float32)
    k = jnp.zeros((2, 1, 2, 4))  # token-major chunk [B,T,K,H]
    with pytest.raises(ValueError, match="must be \\[B=2, T, K=2, H=4\\]"):
        cache.update(k[:, :, :1], k[:, :, :1], jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="new pos"):
        cache.update(k, k, jnp.zeros((2, 3), jnp.int32))

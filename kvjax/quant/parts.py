"""The optional parts of a `QuantKVCache`, each a small pytree with its own arrays, what it does when tokens
are quantized, what it adds back when the cache is read, and its exact bytes: exact outliers (KVQuant's
dense-and-sparse split, GEAR's extremes), exact attention sinks (KVQuant) and a low-rank approximation
of each block's quantization error (GEAR). A scheme (`kvjax/quant/schemes/`) switches parts on; the
cache holds None for the parts it lacks. Arrays are head-major `[B,K,S,...]` like the codes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import _scatter


def scatter_head_major(buf, slots, values):
    """values `[B,K,T,...]` to slots `[B,T]` of buf `[B,K,S,...]` (slots outside [0, S) dropped)."""
    return _scatter(buf, slots, jnp.moveaxis(values, 1, 2), head_major=True)


def split_outliers(x, n: int, extremes: bool = False):
    """x `[..., H]` -> (x with each vector's n outliers replaced, their values, their channels). KVQuant:
    the n largest magnitudes, zeroed; GEAR (`extremes`): the n/2 largest and n/2 smallest entries, set
    to the vector's mean."""
    f = x.astype(jnp.float32)
    if extremes:
        idx = jnp.concatenate([jax.lax.top_k(f, n // 2)[1], jax.lax.top_k(-f, n // 2)[1]], axis=-1)
        fill = jnp.broadcast_to(f.mean(axis=-1, keepdims=True), idx.shape).astype(x.dtype)
    else:
        idx = jax.lax.top_k(jnp.abs(f), n)[1]
        fill = jnp.zeros(idx.shape, x.dtype)
    values = jnp.take_along_axis(x, idx, axis=-1)
    return jnp.put_along_axis(x, idx, fill, axis=-1, inplace=False), values, idx.astype(jnp.uint8)


def restore_outliers(x: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """x `[..., H]` with each vector's exact outliers (values at channels idx `[..., n]`) written back:
    one select per outlier, which XLA fuses into the dequantization (a scatter would not fuse)."""
    channel = jnp.arange(x.shape[-1], dtype=jnp.int32).reshape((1,) * (x.ndim - 1) + (-1,))
    for j in range(idx.shape[-1]):
        x = jnp.where(channel == idx[..., j : j + 1].astype(jnp.int32), values[..., j : j + 1].astype(x.dtype), x)
    return x


def low_rank(error: jax.Array, rank: int, loops: int = 3) -> tuple[jax.Array, jax.Array]:
    """GEAR's power iteration (`fake_poweriteration_group`): Q `[..., T, r]` and P `[..., H, r]` with
    Q P^T ~ error `[..., T, H]`; P starts from a fixed U[0, 1) draw, QR only on the last pass."""
    e = error.astype(jnp.float32)
    p = jnp.broadcast_to(jax.random.uniform(jax.random.key(0), (e.shape[-1], rank)), (*e.shape[:-2], e.shape[-1], rank))
    for i in range(loops):
        last = i == loops - 1
        if last:
            p = jnp.linalg.qr(p)[0]
        q = e @ p
        if last:
            q = jnp.linalg.qr(q)[0]
        p = e.swapaxes(-1, -2) @ q
    return q, p


def block_error_factors(exact, recon, residual: int, rank: int) -> tuple[jax.Array, jax.Array]:
    """GEAR's factors of the quantization error exact - recon (`[B,K,W,H]`, dequantized with its outliers
    back): Q `[B,K,W,r]` of each token and P `[B,K,ceil(W/residual),H,r]` of each block of `residual`."""
    B, K, W, H = exact.shape
    Wr = -(-W // residual) * residual
    error = jnp.pad(exact.astype(jnp.float32) - recon, ((0, 0), (0, 0), (0, Wr - W), (0, 0)))
    q, p = low_rank(error.reshape(B, K, Wr // residual, residual, H), rank)
    return q.reshape(B, K, Wr, -1)[:, :, :W], p


@struct.dataclass
class Outliers:
    """Each token vector's `n` outlier entries kept exactly beside the codes: values (model dtype) and
    their channels (uint8) `[B,K,S,n]` for keys and for values."""

    k: jax.Array
    k_idx: jax.Array
    v: jax.Array
    v_idx: jax.Array

    @classmethod
    def init(cls, B: int, K: int, S: int, n: int, dtype) -> Outliers:
        values, channels = jnp.zeros((B, K, S, n), dtype), jnp.zeros((B, K, S, n), jnp.uint8)
        return cls(k=values, k_idx=channels, v=values, v_idx=channels)

    @staticmethod
    def nbytes(capacity: int, K: int, n: int, item: int) -> int:
        return capacity * 2 * K * n * (item + 1)

    @classmethod
    def taken_from(cls, k, v, n: int, extremes: bool) -> tuple[jax.Array, jax.Array, Outliers]:
        """k, v `[B,K,W,H]` about to be quantized -> (k, v with their outliers replaced, the outliers
        `[B,K,W,n]` as a part of those W tokens)."""
        (k, k_out, k_idx), (v, v_out, v_idx) = split_outliers(k, n, extremes), split_outliers(v, n, extremes)
        return k, v, cls(k=k_out, k_idx=k_idx, v=v_out, v_idx=v_idx)

    def written(self, slots, chunk: Outliers) -> Outliers:
        """This part with a chunk's outliers (`taken_from`, token t of row b) written to slots `[B,W]`."""
        return jax.tree.map(lambda buf, new: scatter_head_major(buf, slots, new), self, chunk)

    def apply(self, k, v) -> tuple[jax.Array, jax.Array]:
        """Dequantized k, v `[B,K,S,H]` (or a chunk's) with their outliers written back."""
        return restore_outliers(k, self.k_idx, self.k), restore_outliers(v, self.v_idx, self.v)


@struct.dataclass
class Sinks:
    """The first `sinks` tokens of each row kept in full precision `[B,K,sinks,H]` (written as they
    arrive; they replace those slots' dequantized values when the cache is read)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, B: int, K: int, sinks: int, H: int, dtype) -> Sinks:
        return cls(k=jnp.zeros((B, K, sinks, H), dtype), v=jnp.zeros((B, K, sinks, H), dtype))

    @staticmethod
    def nbytes(K: int, sinks: int, H: int, item: int) -> int:
        return 2 * K * sinks * H * item

    def write(self, index, k, v) -> Sinks:
        """k, v `[B,K,T,H]` of the tokens held `index`-th `[B,T]`: those below `sinks` are kept."""
        return Sinks(k=scatter_head_major(self.k, index, k), v=scatter_head_major(self.v, index, v))

    def apply(self, k, v, held) -> tuple[jax.Array, jax.Array]:
        """k, v `[B,K,S,H]` with the first n slots exact where `held` `[B|1,n]` (the slot still holds its
        sink: a ring overwrites them too)."""
        n = held.shape[1]
        exact = lambda x, sink: jnp.where(held[:, None, :, None], sink[:, :, :n].astype(x.dtype), x[:, :, :n])  # noqa: E731
        return k.at[:, :, :n].set(exact(k, self.k)), v.at[:, :, :n].set(exact(v, self.v))


@struct.dataclass
class LowRankError:
    """GEAR's low-rank error: for each block of `residual` tokens, factors with Q P^T ~ (exact - dequantized):
    Q per token `[B,K,S,r]` and P per block `[B,K,ceil(S/residual),H,r]`, for keys and for values."""

    k_q: jax.Array
    k_p: jax.Array
    v_q: jax.Array
    v_p: jax.Array
    residual: int = struct.field(pytree_node=False)

    @classmethod
    def init(cls, B: int, K: int, S: int, H: int, rank: int, residual: int, dtype) -> LowRankError:
        q, p = jnp.zeros((B, K, S, rank), dtype), jnp.zeros((B, K, -(-S // residual), H, rank), dtype)
        return cls(k_q=q, k_p=p, v_q=q, v_p=p, residual=residual)

    @staticmethod
    def nbytes(capacity: int, K: int, H: int, rank: int, residual: int, item: int) -> int:
        return capacity * 2 * K * rank * item + -(-capacity // residual) * 2 * K * H * rank * item

    def write(self, exact_k, exact_v, recon_k, recon_v, slots, bslots) -> LowRankError:
        """The factors of the blocks just quantized: exact and dequantized k, v `[B,K,W,H]` of the tokens
        going to slots `[B,W]`, each block of `residual` of them to its block slot `bslots` `[B,W/residual]`."""
        (k_q, k_p), (v_q, v_p) = self._factors(exact_k, recon_k), self._factors(exact_v, recon_v)
        return self.replace(
            k_q=scatter_head_major(self.k_q, slots, k_q),
            k_p=scatter_head_major(self.k_p, bslots, k_p),
            v_q=scatter_head_major(self.v_q, slots, v_q),
            v_p=scatter_head_major(self.v_p, bslots, v_p),
        )

    def _factors(self, exact, recon):
        return block_error_factors(exact, recon, self.residual, self.k_q.shape[-1])

    def apply(self, k, v) -> tuple[jax.Array, jax.Array]:
        return k + self._error(self.k_q, self.k_p), v + self._error(self.v_q, self.v_p)

    def _error(self, q: jax.Array, p: jax.Array) -> jax.Array:
        """The error approximation `[B,K,S,H]`: each slot's Q `[B,K,S,r]` times its block's P
        `[B,K,S/residual,H,r]` (slots padded to whole blocks, never P repeated per slot)."""
        (B, K, S, r), (n_blocks, H) = q.shape, p.shape[2:4]
        R = self.residual
        q = jnp.pad(q, ((0, 0), (0, 0), (0, n_blocks * R - S), (0, 0))).reshape(B, K, n_blocks, R, r)
        return jnp.einsum("BKCRr,BKCHr->BKCRH", q, p).reshape(B, K, n_blocks * R, H)[:, :, :S]

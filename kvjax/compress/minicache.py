"""MiniCache (Liu et al. 2024, arXiv 2405.14366, sec. 4): adjacent layers in the upper half of a model
have K/V of similar direction, so each pair (l, l+1) stores one direction per token and head, the
SLERP of the two layers' unit vectors (eq. 3, t = 0.6), and each layer's own magnitude; a layer's
K/V are restored as magnitude x direction. Tokens whose two vectors are far apart in angle keep both
originals (token retention).

Stored per merged pair, separately for K and V, per token and KV head: the direction `[B,K,T,H]`,
two magnitudes `[B,K,T,2]`, and for the `retain` fraction of tokens with the largest angular distance
(Omega / pi, measured on the keys; the values reuse those tokens) both layers' originals and their
slot. The pair's positions are stored once. The first layer of a pair holds all of that
(`MergedKVCache`); the second (`PartnerKVCache`) holds only what it decodes afterwards and reads the
merged part from its partner's slot (`Decoder` joins them, `source`).

Choices the paper leaves open (its retention rule was not verified here; no official code): the
budget `minicache:R` is the fraction of compressible layers merged, from the top (R = 0.5: from the
middle layer, the paper's default); retention keeps ceil(retain x T) tokens per head (`retain=0.05`,
as the KVCache-Factory reimplementation); tokens decoded after the merge stay unmerged in each
layer's own tail (the paper merges them too, once both layers have them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, KVView, _Arrays

_EPS = 1e-6  # |cos| is clamped to 1 - eps, and SLERP falls back to LERP where sin(Omega) < eps


def merged_pairs(n_caches: int, ratio: float) -> tuple[tuple[int, int], ...]:
    """The (lower, upper) indices among `n_caches` compressible caches merged at `ratio`: the top
    round(ratio x n) caches, paired from the first of them upward (an odd one out stays unmerged)."""
    n = int(round(ratio * n_caches))
    start = n_caches - n
    return tuple((j, j + 1) for j in range(start, n_caches - 1, 2))


def angle(a: jax.Array, b: jax.Array) -> jax.Array:
    """Omega `[...]`, the angle between vectors a and b `[..., H]` (fp32)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    cos = jnp.sum(a * b, -1) / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30)
    return jnp.arccos(jnp.clip(cos, -1 + _EPS, 1 - _EPS))


def slerp_direction(a: jax.Array, b: jax.Array, t: float) -> jax.Array:
    """Eq. 3: sin((1-t) Omega)/sin(Omega) a/|a| + sin(t Omega)/sin(Omega) b/|b| (fp32, unit length);
    plain interpolation of the unit vectors, renormalised, where sin(Omega) is below eps."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    ua = a / jnp.maximum(jnp.linalg.norm(a, axis=-1, keepdims=True), 1e-30)
    ub = b / jnp.maximum(jnp.linalg.norm(b, axis=-1, keepdims=True), 1e-30)
    omega = angle(a, b)[..., None]
    sin = jnp.sin(omega)
    small = sin < _EPS
    safe = jnp.where(small, 1.0, sin)
    slerp = (jnp.sin((1 - t) * omega) / safe) * ua + (jnp.sin(t * omega) / safe) * ub
    lerp = (1 - t) * ua + t * ub
    lerp = lerp / jnp.maximum(jnp.linalg.norm(lerp, axis=-1, keepdims=True), 1e-30)
    return jnp.where(small, lerp, slerp)


def retained_slots(k_a, k_b, pos, count: int) -> jax.Array:
    """Slots `[B,K,count]` of the tokens whose keys differ most in angle between the two layers
    (empty slots never), in slot order."""
    d = angle(k_a, k_b) / jnp.pi  # [B,K,S]
    d = jnp.where(pos[:, None, :] >= 0, d, -1.0)
    _, idx = jax.lax.top_k(d, count)
    return jnp.sort(idx, axis=-1)


def _restore(direction, magnitude, slots, originals):
    """magnitude x direction, with the retained slots' originals written back: `[B,K,S,H]`."""
    x = (direction.astype(jnp.float32) * magnitude[..., None].astype(jnp.float32)).astype(originals.dtype)
    B, K = slots.shape[:2]
    return x.at[jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], slots].set(originals)


@struct.dataclass
class MergedKVCache(_Arrays):
    """The merged part of a layer pair and the first layer's own tail (module docstring)."""

    k_dir: jax.Array  # [B,K,T,H] unit directions, model dtype
    v_dir: jax.Array
    k_mag: jax.Array  # [B,K,T,2] magnitudes of the lower and upper layer
    v_mag: jax.Array
    pos: jax.Array  # [B,T]
    kept: jax.Array  # [B,K,R] slots whose originals are kept
    k_kept: jax.Array  # [B,K,R,2,H] originals of both layers
    v_kept: jax.Array
    tail: KVCache  # what this (lower) layer decodes after the merge

    @classmethod
    def merge(cls, lower: KVCache, upper: KVCache, slots: int, tail: int, t: float, retain: float):
        """Merge the first `slots` slots of two dense caches of the same tokens; `tail` slots follow."""
        pos = lower.pos[:, :slots]
        ka, kb, va, vb = (x[:, :, :slots] for x in (lower.k, upper.k, lower.v, upper.v))
        count = min(slots, math.ceil(retain * slots - 1e-9))
        kept = retained_slots(ka, kb, pos, count)
        B, K, _, H = ka.shape

        def take(x):
            return jnp.take_along_axis(x, kept[..., None], axis=2)

        def norms(a, b):
            return jnp.stack(
                [jnp.linalg.norm(a.astype(jnp.float32), axis=-1), jnp.linalg.norm(b.astype(jnp.float32), axis=-1)], -1
            ).astype(ka.dtype)

        filled = (pos >= 0)[:, None, :, None]
        return cls(
            k_dir=jnp.where(filled, slerp_direction(ka, kb, t), 0).astype(ka.dtype),
            v_dir=jnp.where(filled, slerp_direction(va, vb, t), 0).astype(va.dtype),
            k_mag=norms(ka, kb),
            v_mag=norms(va, vb),
            pos=pos,
            kept=kept.astype(jnp.int32),
            k_kept=jnp.stack([take(ka), take(kb)], axis=3),
            v_kept=jnp.stack([take(va), take(vb)], axis=3),
            tail=KVCache.init(B, tail, K, H, ka.dtype),
        )

    def restored(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """The merged slots' K and V `[B,K,T,H]` of the pair's lower (0) or upper (1) layer."""
        return (
            _restore(self.k_dir, self.k_mag[..., layer], self.kept, self.k_kept[:, :, :, layer]),
            _restore(self.v_dir, self.v_mag[..., layer], self.kept, self.v_kept[:, :, :, layer]),
        )

    def view(self, layer: int, tail: KVView) -> KVView:
        k, v = self.restored(layer)
        return KVView(
            jnp.concatenate([k, tail.k], axis=2),
            jnp.concatenate([v, tail.v], axis=2),
            jnp.concatenate([self.pos, tail.pos], axis=1),
        )

    def update(self, k, v, pos):
        tail, view = self.tail.update(k, v, pos)
        return self.replace(tail=tail), self.view(0, view)


@struct.dataclass
class PartnerKVCache(_Arrays):
    """The upper layer of a merged pair: its own tail; `merged` is its partner's `MergedKVCache`,
    joined in only while the layer runs (`source`: the partner's cache index) and never stored here."""

    tail: KVCache
    merged: MergedKVCache | None = None
    source: int = struct.field(pytree_node=False, default=-1)

    def update(self, k, v, pos):
        if self.merged is None:
            raise ValueError("a MiniCache partner attends through its pair's merged cache: join it first")
        tail, view = self.tail.update(k, v, pos)
        return self.replace(tail=tail), self.merged.view(1, view)


def merge_caches(caches: list, slots: tuple[int, ...], ratio: float, keep_caps, capacities, t: float, retain: float):
    """The caches with the pairs of `merged_pairs` merged: the lower cache becomes a `MergedKVCache`
    of its first keep_cap slots (tail: the rest of its capacity), the upper one a `PartnerKVCache`."""
    caches = list(caches)
    for a, b in merged_pairs(len(slots), ratio):
        lower, upper = caches[slots[a]], caches[slots[b]]
        tail = capacities[a] - keep_caps[a]
        caches[slots[a]] = MergedKVCache.merge(lower, upper, keep_caps[a], tail, t, retain)
        B, K, _, H = upper.k.shape
        caches[slots[b]] = PartnerKVCache(tail=KVCache.init(B, tail, K, H, upper.k.dtype), source=slots[a])
    return caches


def merged_bytes(slots: int, tail: int, K: int, H: int, item: int, retain: float) -> tuple[int, int]:
    """Exact bytes of one sequence's `MergedKVCache` of `slots` merged slots and `tail` more, and of its
    `PartnerKVCache`: directions, magnitudes, positions, retained slots and originals, and the tails."""
    tail_bytes = tail * (2 * K * H * item + 4) + 4
    count = min(slots, math.ceil(retain * slots - 1e-9))
    merged = slots * (2 * K * H * item + 2 * 2 * K * item + 4) + count * K * (4 + 2 * 2 * H * item)
    return merged + tail_bytes, tail_bytes

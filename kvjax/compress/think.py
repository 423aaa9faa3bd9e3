"""ThinK (Xu et al. 2024, arXiv 2407.21018, sec. 3): query-driven pruning of key channels. Per KV head,
channel c scores ||Q_window[:, c]|| x ||K[:, c]||, ranked as the reference code ranks it, by
mean over the last `obs_window` prompt queries of q_c^2 times mean over the kept keys of k_c^2
(`key_pruner_query_driven`); the int(ratio x head_dim) lowest channels of every prompt token's key are
dropped (not stored), except for the last `window` prompt tokens, and tokens decoded afterwards keep
full keys (the reference's unpruned recent 32 and generated tokens). Values are untouched. At
attention the kept channels are put back among zeros (the reference's `recover_cache`), so old
tokens' logits sum over kept channels only, still scaled by 1/sqrt(head_dim).

It runs after token eviction (`snapkv:0.5+think:0.4`), scoring the keys that eviction kept. Deviation:
scores per KV head, the squared queries averaged over the head's query group (kvpress's `ThinKPress`;
the reference repeats K/V per query head first, which stores G times more keys under GQA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, KVView, WindowKVCache, _Arrays


class ChannelStat(NamedTuple):
    """Mean squared observed query per KV head and channel `[B,K,H]` (not per slot: reducers pass it on)."""

    q2: jax.Array


def observe(stage, queries: jax.Array | None, obs_pos: jax.Array) -> ChannelStat:
    """Mean q_c^2 over the last `obs_window` observed queries `[B,W,N,H]` and each KV head's query group."""
    if queries is None:
        raise ValueError("ThinK scores channels of per-head queries; an MLA layer has none")
    last = jnp.max(obs_pos, axis=1)[:, None]
    voter = (obs_pos >= 0) & (obs_pos > last - stage.options.obs_window)  # [B,W]
    q2 = jnp.where(voter[:, :, None, None], queries.astype(jnp.float32) ** 2, 0.0)
    return ChannelStat(q2.sum(axis=1) / jnp.maximum(voter.sum(axis=1), 1)[:, None, None])  # [B,N,H]


def channel_scores(q2: jax.Array, k: jax.Array, pos: jax.Array) -> jax.Array:
    """Scores `[B,K,H]`: mean q^2 of each KV head's query group `[B,N,H]` times mean k^2 over the filled
    slots of k `[B,K,S,H]` (pos `[B,S]` or `[B,K,S]`)."""
    B, K, S, H = k.shape
    filled = (pos >= 0) if pos.ndim == 3 else jnp.broadcast_to((pos >= 0)[:, None], (B, K, S))
    k2 = (
        jnp.where(filled[..., None], k.astype(jnp.float32) ** 2, 0).sum(axis=2)
        / jnp.maximum(filled.sum(-1), 1)[..., None]
    )
    q2 = q2.reshape(B, K, -1, H).mean(axis=2)
    return q2 * k2


def kept_channels(scores: jax.Array, ratio: float) -> jax.Array:
    """Indices `[B,K,H - int(ratio x H)]` of the best-scored channels, ascending."""
    H = scores.shape[-1]
    _, idx = jax.lax.top_k(scores, H - int(ratio * H + 1e-9))
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def _pruned_channels(channels: jax.Array, H: int) -> jax.Array:
    """The complement of `channels` `[B,K,Hk]` in range(H), ascending `[B,K,H-Hk]`."""
    kept = (
        jnp.zeros((*channels.shape[:2], H), bool)
        .at[jnp.arange(channels.shape[0])[:, None, None], jnp.arange(channels.shape[1])[None, :, None], channels]
        .set(True)
    )
    return jnp.argsort(kept, axis=-1, stable=True)[..., : H - channels.shape[-1]].astype(jnp.int32)


@struct.dataclass
class ThinKCache(_Arrays):
    """Prompt tokens with pruned keys: kept channels `k` `[B,K,S,Hk]` (`channels` `[B,K,Hk]`), full values,
    positions, and for the last `window` prompt slots (`recent` `[B,K,R]`) the dropped channels too
    (`k_recent` `[B,K,R,H-Hk]`); tokens decoded afterwards go to a full `tail` (a sliding-window layer's,
    under `local=true`, a `WindowKVCache` of at most W slots, so decoding stays capped)."""

    k: jax.Array
    channels: jax.Array
    recent: jax.Array
    k_recent: jax.Array
    v: jax.Array
    pos: jax.Array
    length: jax.Array
    tail: KVCache

    @classmethod
    def from_cache(
        cls, cache: KVCache, stat: ChannelStat, ratio: float, window: int, headroom: int, ring: bool = False
    ) -> ThinKCache:
        """Prune the keys of a compacted KV cache (slots 0..length-1 in position order); `headroom` tail slots
        for the tokens to come (`ring`: over the oldest once full)."""
        B, K, S, H = cache.k.shape
        channels = kept_channels(channel_scores(stat.q2, cache.k, cache.pos), ratio)
        heads = (jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None])
        k = jnp.take_along_axis(cache.k, jnp.broadcast_to(channels[:, :, None, :], (B, K, S, channels.shape[-1])), -1)
        R = min(window, S)
        recent = jnp.clip(cache.length[:, None, None] - R + jnp.arange(R)[None, None, :], 0, S - 1)
        recent = jnp.broadcast_to(recent, (B, K, R)).astype(jnp.int32)
        rest = _pruned_channels(channels, H)
        k_recent = cache.k[heads[0][..., None], heads[1][..., None], recent[..., None], rest[:, :, None, :]]
        tail = (WindowKVCache if ring else KVCache).init(B, headroom, K, H, cache.k.dtype)
        return cls(
            k=k,
            channels=channels,
            recent=recent,
            k_recent=k_recent,
            v=cache.v,
            pos=cache.pos,
            length=cache.length,
            tail=tail,
        )

    def keys(self) -> jax.Array:
        """The prompt keys `[B,K,S,H]` as attention reads them: kept channels among zeros, the recent
        slots whole."""
        B, K, S, Hk = self.k.shape
        H = self.v.shape[-1]
        rows, heads = jnp.arange(B)[:, None, None, None], jnp.arange(K)[None, :, None, None]
        slots = jnp.arange(S)[None, None, :, None]
        full = jnp.zeros((B, K, S, H), self.k.dtype).at[rows, heads, slots, self.channels[:, :, None, :]].set(self.k)
        rest = _pruned_channels(self.channels, H)
        return full.at[rows, heads, self.recent[..., None], rest[:, :, None, :]].set(self.k_recent)

    def update(self, k, v, pos):
        tail, view = self.tail.update(k, v, pos)
        prompt_pos = self.pos
        tail_pos = view.pos
        if prompt_pos.ndim == 3:
            tail_pos = jnp.broadcast_to(tail_pos[:, None], (*prompt_pos.shape[:2], tail_pos.shape[-1]))
        return self.replace(tail=tail), KVView(
            jnp.concatenate([self.keys(), view.k], axis=2),
            jnp.concatenate([self.v, view.v], axis=2),
            jnp.concatenate([prompt_pos, tail_pos], axis=-1),
        )


def think_bytes(slots: int, tail: int, K: int, H: int, ratio: float, window: int, item: int, positions: int) -> int:
    """Exact bytes of one sequence's `ThinKCache`: pruned keys, values, positions, channel indices, the
    recent slots' dropped channels, the length and the full tail."""
    Hk = H - int(ratio * H + 1e-9)
    R = min(window, slots)
    prompt = slots * (K * (Hk + H) * item + 4 * positions) + K * Hk * 4 + R * K * (4 + (H - Hk) * item) + 4
    return prompt + tail * (2 * K * H * item + 4) + 4

"""The one attention op every attention mixer calls.

GQA groups the queries (`[B,T,K,G,H]`) instead of repeating K/V in memory, and the mask is computed from
positions alone: a key is visible when `0 <= k_pos <= q_pos` and, with a sliding window,
`q_pos - k_pos < window`. Logits and softmax are computed in fp32. `softcap` bounds the scaled logits to
(-cap, cap) by `cap * tanh(logits / cap)` before the mask (Gemma 2's attention logit soft-capping; Gemma
Team 2024, arXiv 2408.00118, sec. 2); the Pallas kernels have no soft-capping, so `auto` runs XLA then.

Keys and values are head-major, `[B,K,S,H]`, the layout caches store: both einsums are then plain batched
matmuls over (B, K). With token-major `[B,S,K,H]`, XLA:CPU copies the whole cache into head-major order
before each dot, and a decode step's attention took 4.5x its memory-read floor instead of 1.8x
(scripts/bench_decode.py model, batch 8, 2048 tokens).

A single query per row (a decode step) takes a blocked path: the keys are split into blocks of
`decode_block(S)` slots, logits laid out `[B,K,C,G,s]`, one softmax over all blocks, and the value
product taken per block then summed (the split-K of flash-decoding, without its separate rescaling
since every block's logits are in memory). Same result, but XLA:CPU runs the many small per-block
products faster than one long product per head: in scripts/bench_decode.py the attention of a step went
from 13.5-14.0 ms to 9.2-9.3 ms and the whole step from 18-19.5 ms to 13.4-14.3 ms. MLA's absorbed
decode calls `blocked_decode` with two logit parts (latent and RoPE).

`impl` picks the backend (`kvjax.impls`, tokamax's pattern: the XLA path is the reference and always
works): `xla`; `pallas`, the kernels of `pallas_kernels/` (flash attention for several queries per row,
with its backward; flash-decoding for one), compiled by Mosaic on TPU, Triton on GPU, and interpreted on
CPU; `cudnn` (GPU) and `splash` (TPU), the field's prefill and training kernels for a chunk over its own
keys, Pallas for the rest; `auto`, the platform's best where it takes the call (cuDNN or splash, then
Pallas), XLA otherwise (CPU included). A pooled
(AdaKV) cache has no kernel: `pallas` refuses it, `auto` runs XLA. A decode step over an int or KIVI
cache (`quant`, the codes a `QuantKVCache` stores) runs the fused dequantize-attend kernel under Pallas
(KIVI's full-precision residual through the decode kernel, merged by `combine`); XLA attends to the
dequantized K/V. Likewise a decode step over a paged cache (`paged`, a `kvjax.paged.PagedKVCache`)
runs the paged kernel, reading pages through the block tables; XLA attends to the gathered pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.impls import IMPLS, PLATFORM_IMPLS, Chunk, choose
from kvjax.pallas_kernels import decode_attention, flash_attention
from kvjax.pallas_kernels.decode_attention import combine, decode_partials
from kvjax.pallas_kernels.paged_decode_attention import paged_decode_attention
from kvjax.pallas_kernels.quant_decode_attention import check as check_quant_kernel
from kvjax.pallas_kernels.quant_decode_attention import quant_decode_partials

DECODE_BLOCK_RANGE = (32, 128, 256)  # smallest, preferred largest, largest key block of the decode path
PREFILL_BLOCK = 256  # query rows per block of `causal_blocks` (128 and 256 ran alike; 512 slower)
KEY_BLOCK_RANGE = (512, 2048)  # key blocks of `key_blocks`: a chunk's fp32 scores are [C, block] per head
# Finite, so a fully masked row (a padding query) cannot produce NaN; its probabilities are then zeroed,
# so it outputs 0 and every masked key gets exactly zero probability and zero gradient.
_MASKED = -1e30


def visible(
    q_pos: jax.Array, k_pos: jax.Array, window: int | None = None, sinks: int = 0, horizon: int | None = None
) -> jax.Array:
    """Boolean mask: which keys each query may attend to, from positions alone. `[B,T,S]` for key
    positions shared by every KV head `[B,S]`; `[B,K,T,S]` for per-head positions `[B,K,S]` (a cache
    compressed head by head keeps different tokens in each head). With a window, the first `sinks`
    positions stay visible too (StreamingLLM's attention sinks: DuoAttention's streaming heads), unless
    they are `horizon` or more positions back (a streaming head in a sliding-window layer)."""
    if k_pos.ndim == 2:
        q, k = q_pos[:, :, None], k_pos[:, None, :]
    else:
        q, k = q_pos[:, None, :, None], k_pos[:, :, None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= (q - k < window) | (k < sinks)
    if horizon is not None:
        mask &= q - k < horizon
    return mask


def grouped_mask(q_pos, k_pos, window, k_head, n_kv_heads, sinks: int = 0, horizon: int | None = None) -> jax.Array:
    """`visible` laid out as `[B,K|1,T,1,S]` for `[B,K,T,G,S]` logits; with `k_head` `[B,S]` (a pooled
    cache, see `kvjax.cache.PooledKVCache`) a key is visible only to the query heads of its KV head."""
    mask = visible(q_pos, k_pos, window, sinks, horizon)
    mask = mask[:, None, :, None, :] if mask.ndim == 3 else mask[:, :, :, None, :]
    if k_head is not None:
        own = k_head[:, None, :] == jnp.arange(n_kv_heads, dtype=k_head.dtype)[None, :, None]  # [B,K,S]
        mask = mask & own[:, :, None, None, :]
    return mask


def _check(q, k, v, q_pos, k_pos, window, impl, k_head, n_kv_heads) -> int:
    """Validates shapes; returns the number of KV heads K."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} must be one of {IMPLS}")
    if k_head is None:
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"q {q.shape} must be [B,T,N,H]; k {k.shape} [B,K,S,H] and v {v.shape} [B,K,S,Hv]")
        K, S = k.shape[1], k.shape[2]
    else:
        if q.ndim != 4 or k.ndim != 3 or v.ndim != 3 or v.shape[:2] != k.shape[:2] or k_head.shape != k.shape[:2]:
            raise ValueError(
                f"pooled attention: q {q.shape} must be [B,T,N,H]; k {k.shape} [B,P,H], v {v.shape} [B,P,Hv] "
                f"and k_head {k_head.shape} [B,P]"
            )
        if n_kv_heads is None:
            raise ValueError("pooled attention (k_head given) needs n_kv_heads")
        K, S = n_kv_heads, k.shape[1]
    (B, T, N, H), Bk, Hk = q.shape, k.shape[0], k.shape[-1]
    if B != Bk or H != Hk:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    if q_pos.shape != (B, T) or k_pos.shape not in ((B, S), (B, K, S)) or (k_head is not None and k_pos.ndim == 3):
        raise ValueError(
            f"q_pos {q_pos.shape} must be {(B, T)} and k_pos {k_pos.shape} must be {(B, S)} or, per head, {(B, K, S)}"
        )
    if window is not None and window <= 0:
        raise ValueError(f"window={window} must be > 0 or None")
    return K


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    impl: str = "xla",
    k_head: jax.Array | None = None,
    n_kv_heads: int | None = None,
    quant=None,
    paged=None,
    fresh: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """softmax(q k^T * scale, masked by positions) v, for q `[B,T,N,H]`, k `[B,K,S,H]`, v `[B,K,S,Hv]`.

    Returns `[B,T,N,Hv]` in q's dtype; a query that sees no key (padding) gets zeros. `scale` defaults
    to 1/sqrt(H). k_pos is `[B,S]`, or `[B,K,S]` when each KV head holds different tokens. A pooled
    cache passes k `[B,P,H]`, v `[B,P,Hv]`, k_pos `[B,P]`, each entry's KV head `k_head` `[B,P]` and
    `n_kv_heads`. `quant` (a `kvjax.quant.QuantizedKV`) is the same K/V as stored codes, `paged` (a
    `kvjax.paged.PagedKVCache`) as pages of a pool: a decode step under Pallas reads those instead of
    k and v. `fresh=T` (T, the number of queries) promises that key slot t holds query t's own token for
    t < T, in order, and that later slots are empty (`KVView.fresh`): only those T slots are read, and
    (XLA) `causal_blocks` skips what causality hides.
    """
    K = _check(q, k, v, q_pos, k_pos, window, impl, k_head, n_kv_heads)
    T = q.shape[1]
    own = fresh == T and T > 1 and k_head is None  # a chunk over its own keys (see the docstring)
    chunk = Chunk(T, q.dtype.name, q.shape[-1], v.shape[-1], per_head=k_pos.ndim == 3) if own else None
    backend = kernel_impl(impl, pooled=k_head is not None, softcap=softcap, chunk=chunk)
    if own:
        k, v, k_pos = k[:, :, :T], v[:, :, :T], k_pos[..., :T]
        if backend in PLATFORM_IMPLS:
            return PLATFORM_IMPLS[backend].attention(q, k, v, q_pos, k_pos, window=window, scale=scale, softcap=softcap)
        if backend == "xla":
            return causal_blocks(q, k, v, q_pos, k_pos, window, scale, impl, softcap=softcap)
    if backend == "pallas" and quant is not None and q.shape[1] == 1 and _fused_quant(quant, impl):
        return _quant_decode(q, quant, q_pos, window, scale, K)
    if backend == "pallas" and paged is not None and T == 1:
        return _paged_decode(q, paged, q_pos, window, scale, K)
    if backend == "pallas":
        return _pallas_attention(q, k, v, q_pos, k_pos, window, scale, K)
    block = key_block(k.shape[2]) if T > 1 and k_head is None else None
    if block is not None:  # a chunk over a long cache (see `key_blocks`)
        return key_blocks(q, k, v, q_pos, k_pos, window, scale, block, softcap)
    block = decode_block(k.shape[2]) if q.shape[1] == 1 and k_head is None else None
    if block is not None:  # a decode step (see the module docstring)
        B, _, N, H = q.shape
        scale = H**-0.5 if scale is None else scale
        parts = ((q.reshape(B, K, N // K, H), k),)
        return blocked_decode(parts, v, q_pos, k_pos, window, scale, block, softcap).astype(q.dtype)
    args = dict(window=window, scale=scale, impl=impl, k_head=k_head, n_kv_heads=n_kv_heads, softcap=softcap)
    probs = attention_probs(q, k, v, q_pos, k_pos, **args)
    return attend(probs, v).astype(q.dtype)


def causal_blocks(q, k, v, q_pos, k_pos, window, scale, impl, block: int = PREFILL_BLOCK, softcap=None) -> jax.Array:
    """Attention of T queries over their own T keys (query t is key t, positions increasing): query block
    i (`block` rows) attends to keys [lo, (i + 1) b) only, lo = 0 or, with a window, the first key
    its first query can see; the keys after the block are causally hidden, the ones before lo out of the
    window. Same result as one softmax over all T keys; about half the work and memory traffic at 2k
    tokens (a 2k-token SmolLM2 attention layer: 0.17 s -> 0.074 s on XLA:CPU)."""
    T = q.shape[1]
    outs = []
    for start in range(0, T, block):
        end = min(T, start + block)
        lo = 0 if window is None else max(0, start - window + 1)
        probs = attention_probs(
            q[:, start:end],
            k[:, :, lo:end],
            v[:, :, lo:end],
            q_pos[:, start:end],
            k_pos[..., lo:end],
            window=window,
            scale=scale,
            impl=impl,
            softcap=softcap,
        )
        outs.append(attend(probs, v[:, :, lo:end]))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


def key_block(n_slots: int) -> int | None:
    """Key-block size of `key_blocks` for a cache of n_slots: its largest divisor in KEY_BLOCK_RANGE
    leaving at least two blocks; None (one softmax over every key) for a shorter cache or no divisor."""
    low, high = KEY_BLOCK_RANGE
    return next((b for b in range(min(high, n_slots // 2), low - 1, -1) if n_slots % b == 0), None)


def key_blocks(q, k, v, q_pos, k_pos, window, scale, block: int, softcap=None) -> jax.Array:
    """Attention of a chunk of queries `[B,T,N,H]` over a long cache `[B,K,S,H]`, `block` keys at a time
    with a running max and sum (the online softmax of FlashAttention, Dao et al. 2022, Alg. 1, in XLA):
    the fp32 scores held are `[T, block]` per query head instead of `[T, S]` (a 2,048-token chunk of
    Llama-3.1-8B's 32 heads over a 128k cache: 32 GiB of scores at once, 0.5 GiB a block). Blocks with no
    key any query sees (empty slots, beyond the chunk, outside every window) are skipped. Same result
    as one softmax up to fp32 rounding; returns `[B,T,N,Hv]` in q's dtype."""
    B, T, N, H = q.shape
    K, S, Hv = k.shape[1], k.shape[2], v.shape[-1]
    scale = H**-0.5 if scale is None else scale
    q5 = q.reshape(B, T, K, N // K, H)
    state = (
        jnp.full((B, K, T, N // K), _MASKED, jnp.float32),  # running max of the visible logits
        jnp.zeros((B, K, T, N // K), jnp.float32),  # running sum of exp(logit - max)
        jnp.zeros((B, K, T, N // K, Hv), jnp.float32),  # running probability-weighted values
    )

    def add(start, carry):
        best, total, acc = carry
        kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2)
        mask = grouped_mask(q_pos, jax.lax.dynamic_slice_in_dim(k_pos, start, block, axis=-1), window, None, K)
        logits = capped(jnp.einsum("BTKGH,BKSH->BKTGS", q5, kb, preferred_element_type=jnp.float32) * scale, softcap)
        logits = jnp.where(mask, logits, _MASKED)
        new = jnp.maximum(best, logits.max(axis=-1))
        p = jnp.where(mask, jnp.exp(logits - new[..., None]), 0.0)
        fade = jnp.exp(best - new)
        pv = jnp.einsum("BKTGS,BKSH->BKTGH", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        return new, total * fade + p.sum(axis=-1), acc * fade[..., None] + pv

    def step(i, carry):
        start = i * block
        seen = visible(q_pos, jax.lax.dynamic_slice_in_dim(k_pos, start, block, axis=-1), window).any()
        return jax.lax.cond(seen, add, lambda _, c: c, start, carry)

    _, total, acc = jax.lax.fori_loop(0, S // block, step, state)
    out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, N, Hv).astype(q.dtype)


def kernel_impl(impl: str, *, pooled: bool = False, softcap: float | None = None, chunk: Chunk | None = None) -> str:
    """What `impl` runs on this device (`kvjax.impls.choose`): xla, pallas, or for a `chunk` over its own
    keys a platform kernel (cudnn, splash)."""
    return choose(impl, jax.default_backend(), pooled=pooled, softcap=softcap, chunk=chunk)


def _pallas_attention(q, k, v, q_pos, k_pos, window, scale, K: int) -> jax.Array:
    B, T, N, H = q.shape
    scale = H**-0.5 if scale is None else scale
    if T == 1:
        out = decode_attention(q.reshape(B, K, N // K, H), k, v, q_pos[:, 0], k_pos, scale=scale, window=window)
        return out.reshape(B, 1, N, v.shape[-1]).astype(q.dtype)
    return flash_attention(q, k, v, q_pos, k_pos, scale=scale, window=window).astype(q.dtype)


def _fused_quant(quant, impl: str) -> bool:
    """Whether the fused quantized kernel takes this layout; under impl='pallas' a layout it cannot
    take is an error naming the constraint, under 'auto' the decode kernel reads the dequantized K/V."""
    try:
        check_quant_kernel(quant.bits, quant.v_codes.shape[-1] * 8 // quant.bits, quant.key_group, quant.value_group)
    except ValueError:
        if impl == "pallas":
            raise
        return False
    return True


def _quant_decode(q, quant, q_pos, window, scale, K: int) -> jax.Array:
    """One query per row over a quantized cache: the fused kernel over the codes, plus KIVI's residual."""
    B, _, N, H = q.shape
    scale = H**-0.5 if scale is None else scale
    q4, qp = q.reshape(B, K, N // K, H), q_pos[:, 0]
    parts = [
        quant_decode_partials(
            q4,
            quant.k_codes,
            quant.k_scale,
            quant.k_zero,
            quant.v_codes,
            quant.v_scale,
            quant.v_zero,
            qp,
            quant.pos,
            bits=quant.bits,
            key_group=quant.key_group,
            value_group=quant.value_group,
            scale=scale,
            window=window,
        )
    ]
    if quant.res_k is not None:
        parts.append(decode_partials(((q4, quant.res_k),), quant.res_v, qp, quant.res_pos, scale=scale, window=window))
    o, m, l = (jnp.concatenate(x, axis=2) for x in zip(*parts))
    return combine(o, m, l)[:, :, : N // K].reshape(B, 1, N, H).astype(q.dtype)


def _paged_decode(q, paged, q_pos, window, scale, K: int) -> jax.Array:
    """One query per row over a paged cache: the paged kernel reads the pages through the block tables."""
    B, _, N, H = q.shape
    scale = H**-0.5 if scale is None else scale
    out = paged_decode_attention(
        q.reshape(B, K, N // K, H),
        paged.k,
        paged.v,
        paged.pos,
        paged.table,
        paged.length,
        q_pos[:, 0],
        scale=scale,
        window=window,
    )
    return out.reshape(B, 1, N, paged.v.shape[-1]).astype(q.dtype)


def decode_block(n_slots: int) -> int | None:
    """Key-block size of the blocked decode path for a cache of n_slots: its largest divisor in
    [32, 128], else in (128, 256], leaving at least two blocks; None (the dense path) when there is
    none, e.g. for a prime n_slots. Any multiple of 32 from 64 slots up qualifies."""
    low, preferred, high = DECODE_BLOCK_RANGE
    for top, bottom in ((preferred, low), (high, preferred + 1)):
        for b in range(min(top, n_slots // 2), bottom - 1, -1):
            if n_slots % b == 0:
                return b
    return None


def blocked_decode(parts, v, q_pos, k_pos, window, scale: float, block: int, softcap=None) -> jax.Array:
    """Attention of one query per row over keys and values split into blocks of `block` slots (see the
    module docstring): the logits are the sum over `parts` of q `[B,K,G,Hp]` . k `[B,K,S,Hp]` (one
    part for plain attention; MLA's absorbed decode has a latent part and a RoPE part), times scale;
    v is `[B,K,S,Hv]`. Returns `[B,1,K*G,Hv]` in fp32."""
    (B, K, G, _), S, Hv = parts[0][0].shape, v.shape[2], v.shape[-1]
    C = S // block
    probs = blocked_probs(parts, q_pos, k_pos, window, scale, block, softcap)
    out = jnp.einsum(
        "BKCGS,BKCSH->BKCGH", probs.astype(v.dtype), v.reshape(B, K, C, block, Hv), preferred_element_type=jnp.float32
    ).sum(axis=2)
    return out.reshape(B, 1, K * G, Hv)


def blocked_probs(parts, q_pos, k_pos, window, scale: float, block: int, softcap=None) -> jax.Array:
    """The probabilities `[B,K,C,G,block]` (fp32) of `blocked_decode`: one softmax over the C key blocks."""
    (B, K, _, _), S = parts[0][0].shape, parts[0][1].shape[2]
    C = S // block
    logits = (
        sum(
            jnp.einsum(
                "BKGH,BKCSH->BKCGS", q, k.reshape(B, K, C, block, k.shape[-1]), preferred_element_type=jnp.float32
            )
            for q, k in parts
        )
        * scale
    )
    logits = capped(logits, softcap)
    mask = visible(q_pos, k_pos, window)[..., 0, :]  # [B,S] or, per head, [B,K,S]
    return masked_probs(logits, mask.reshape(B, -1, C, 1, block), axis=(2, 4))


def attention_probs(
    q,
    k,
    v,
    q_pos,
    k_pos,
    *,
    window=None,
    scale=None,
    impl="xla",
    k_head=None,
    n_kv_heads=None,
    sinks=0,
    horizon=None,
    softcap=None,
) -> jax.Array:
    """The attention probabilities `[B,K,T,G,S]` (fp32) of `attention`, which compressors also observe;
    `sinks` keeps the first positions visible past the window, unless beyond `horizon` (`visible`)."""
    K = _check(q, k, v, q_pos, k_pos, window, impl, k_head, n_kv_heads)
    B, T, N, H = q.shape
    scale = H**-0.5 if scale is None else scale
    q_BTKGH = q.reshape(B, T, K, N // K, H)
    spec = "BTKGH,BKSH->BKTGS" if k_head is None else "BTKGH,BSH->BKTGS"
    logits = capped(jnp.einsum(spec, q_BTKGH, k, preferred_element_type=jnp.float32) * scale, softcap)
    return masked_softmax(logits, q_pos, k_pos, window, k_head=k_head, sinks=sinks, horizon=horizon)


def capped(logits: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's soft-capping of scaled attention logits, `softcap * tanh(logits / softcap)`; None: as is."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def masked_softmax(
    logits: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    window: int | None = None,
    *,
    k_head=None,
    sinks: int = 0,
    horizon: int | None = None,
) -> jax.Array:
    """Attention probabilities from fp32 logits `[B,K,T,G,S]`, masked by positions (`visible`) and, for a
    pooled cache, by each entry's KV head; a query that sees no key gets all zeros."""
    # Every [.., T, G, S] tensor is in the order the dot emits; asking for [.., G, T, S] made XLA:CPU
    # transpose the logits inside each mask op (half of a 2k-token prefill's time).
    # jax.nn.softmax rather than a hand-fused one: its backward rule kept training faster (1.6-2x in
    # scripts/bench_train.py when a hand-fused softmax was tried).
    mask = grouped_mask(q_pos, k_pos, window, k_head, logits.shape[1], sinks, horizon)
    return masked_probs(logits, mask, axis=-1)


def masked_probs(logits: jax.Array, mask: jax.Array, axis=-1) -> jax.Array:
    """Softmax of fp32 logits over `axis` among the keys where `mask` holds; masked keys get exactly 0
    (and a row that sees no key, all zeros)."""
    return jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, _MASKED), axis=axis), 0.0)


def attend(probs: jax.Array, v: jax.Array) -> jax.Array:
    """Probabilities `[B,K,T,G,S]` times values `[B,K,S,Hv]` (or a pool's `[B,S,Hv]`) -> `[B,T,K*G,Hv]`
    (query heads grouped by K)."""
    B, K, T, G, _ = probs.shape
    # Output in the dot's natural order, then transposed (a T-sized copy): asking the einsum for
    # BTKGH directly made XLA:CPU pick a much slower dot (9x in scripts/bench_train.py when tried).
    spec = "BKTGS,BKSH->BKTGH" if v.ndim == 4 else "BKTGS,BSH->BKTGH"
    out_BKTGH = jnp.einsum(spec, probs.astype(v.dtype), v)
    return out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, v.shape[-1])

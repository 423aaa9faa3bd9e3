"""Splash attention on TPUs (jax's `pallas/ops/tpu/splash_attention`: block-sparse flash attention that
skips the blocks a mask hides) for a chunk of queries over its own keys: a causal or sliding-window mask
built once per shape, right-padded rows as segment ids, GQA as its multi-query kernel over each KV head's
group of query heads, Gemma 2's soft-capped logits as its own. Interpreted on CPU for the tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

PLATFORM = "tpu"
BLOCK = 128  # query and key rows per block: a chunk's length must be a multiple of it


def supports(chunk, softcap: float | None) -> str | None:
    """None when splash attention takes the chunk, else why not."""
    del softcap  # splash caps logits itself
    if chunk.tokens % BLOCK:
        return f"splash attention takes chunks of a multiple of {BLOCK} tokens (here {chunk.tokens})"
    if chunk.value_dim != chunk.head_dim:
        return "splash attention takes keys and values of one width"
    if chunk.per_head:
        return "splash attention masks by segments, not by per-head positions"
    return None


def attention(q, k, v, q_pos, k_pos, *, window=None, scale=None, softcap=None, interpret: bool | None = None):
    """softmax(q k^T * scale) v for q `[B,T,N,H]` over its own keys k, v `[B,K,T,H]` (slot t holds query
    t's token; positions -1 past each row's length), causal and, with `window`, limited to the last
    `window` positions; padding queries get zeros. As `kvjax.ops.attention` computes it. Interpreted off a
    TPU (`interpret=False` lowers the TPU kernel from any host)."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    B, T, N, H = q.shape
    K = k.shape[1]
    scale = H**-0.5 if scale is None else scale
    kernel = _kernel(T, N // K, window, softcap, interpret)
    q_BKGTH = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    # Padding queries (segment 1) and padding keys (segment 2) meet nothing; real tokens share segment 0.
    segments = sk.SegmentIds(q=jnp.where(q_pos >= 0, 0, 1), kv=jnp.where(k_pos >= 0, 0, 2))
    per_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over KV heads, each a multi-query kernel
    out_BKGTH = jax.vmap(per_head)(q_BKGTH, k, v, segments)
    out = out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, v.shape[-1])
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0).astype(q.dtype)


@functools.lru_cache(maxsize=32)
def _kernel(tokens: int, group: int, window: int | None, softcap: float | None, interpret: bool):
    """The multi-query splash kernel for one KV head's `group` query heads over `tokens` keys."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (tokens, tokens)
    mask = sm.CausalMask(shape) if window is None else sm.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    sizes = {f"block_{name}": BLOCK for name in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute")}
    blocks = sk.BlockSizes(**sizes, block_q_dq=BLOCK, block_kv_dq=BLOCK)
    with jax.ensure_compile_time_eval():  # the mask's block tables are constants, never a trace's values
        return sk.make_splash_mqa_single_device(
            sm.MultiHeadMask([mask] * group), block_sizes=blocks, attn_logits_soft_cap=softcap, interpret=interpret
        )

"""cuDNN's flash attention on NVIDIA GPUs (`jax.nn.dot_product_attention(implementation="cudnn")`; 680-700
TFLOP/s bf16 at head_dim 128 on an H100 by tokamax's stored timings) for a chunk of queries over its own
keys: causal, a sliding window as cuDNN's left window, right-padded rows as sequence lengths, GQA by its
own grouping. Keys arrive head-major `[B,K,S,H]` (kvjax's cache layout) and go to cuDNN token-major."""

from __future__ import annotations

import jax
import jax.numpy as jnp

PLATFORM = "gpu"
DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256  # Hopper and later (128 before: cuDNN refuses more there, at compile time)


def supports(chunk, softcap: float | None) -> str | None:
    """None when cuDNN's flash attention takes the chunk, else why not."""
    if chunk.dtype not in DTYPES:
        return f"cuDNN's flash attention computes in {' or '.join(DTYPES)}, not {chunk.dtype}"
    if chunk.head_dim > MAX_HEAD_DIM or chunk.head_dim % 8 or chunk.value_dim != chunk.head_dim:
        return f"cuDNN takes heads of one width, a multiple of 8 up to {MAX_HEAD_DIM} (here {chunk.head_dim})"
    if softcap is not None:
        return "cuDNN has no soft-capped logits"
    if chunk.per_head:
        return "cuDNN masks by sequence lengths, not by per-head positions"
    return None


def attention(q, k, v, q_pos, k_pos, *, window=None, scale=None, softcap=None, implementation: str | None = None):
    """softmax(q k^T * scale) v for q `[B,T,N,H]` over its own keys k, v `[B,K,T,H]` (slot t holds query
    t's token; positions -1 past each row's length), causal and, with `window`, limited to the last
    `window` positions, as `kvjax.ops.attention` computes it; padding queries get zeros. Off a GPU (and
    with `implementation="xla"`) jax's XLA implementation of the same call runs instead."""
    del softcap  # refused by `supports`
    if implementation is None:
        implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    lengths = jnp.sum(k_pos >= 0, axis=-1, dtype=jnp.int32)
    out = jax.nn.dot_product_attention(
        q,
        k.swapaxes(1, 2),
        v.swapaxes(1, 2),
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0).astype(q.dtype)

"""Attention implementations by name (tokamax's pattern): the XLA path of `kvjax.ops` is the reference and
always runs; `pallas` is kvjax's own kernels (`pallas_kernels/`: flash prefill and training, decode over
plain, latent, quantized and paged caches); `cudnn` and `splash` are the field's fastest prefill and
training attention on GPUs and TPUs, used for a chunk of queries over its own keys (a prompt's first
chunk, a training sequence) while every other call (decode steps, chunks over a cache) runs kvjax's
kernels; `auto` is the platform's best: XLA on CPU, cuDNN (else Pallas) on GPU, splash (else Pallas) on
TPU. Off their platform the named kernels run stand-ins that compute the same call, as Pallas runs in
interpret mode on CPU: `cudnn` through jax's XLA implementation of `dot_product_attention`, `splash`
interpreted, so every mapping from kvjax's layout and masks to theirs is tested on a CPU.

Each platform implementation is one module here with `PLATFORM`, `supports(chunk, window, softcap)` (None,
or why not) and `attention(q, k, v, q_pos, k_pos, *, window, scale, softcap)`; adding one is that module,
its entry in `PLATFORM_IMPLS` and its row in the tests' equality sweep (tests/kvjax/test_impls.py)."""

from __future__ import annotations

import dataclasses

from kvjax.impls import cudnn, splash

IMPLS = ("xla", "pallas", "cudnn", "splash", "auto")
PLATFORM_IMPLS = {"cudnn": cudnn, "splash": splash}  # prefill and training kernels, by name
BEST = {"gpu": "cudnn", "tpu": "splash"}  # what `auto` tries first on each platform


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A call whose queries attend to their own keys only (`KVView.fresh`), as static facts: the query
    count, the dtype, the key and value head widths, whether keys carry one position per head."""

    tokens: int
    dtype: str
    head_dim: int
    value_dim: int
    per_head: bool = False


def choose(
    impl: str, platform: str, *, pooled: bool = False, softcap: float | None = None, chunk: Chunk | None = None
) -> str:
    """Which implementation runs a call: `xla`, `pallas` or a platform kernel's name. `impl` as configured
    (`model.attention.impl`), `platform` the default device's (`jax.default_backend()`); `chunk` describes
    a chunk over its own keys, the one call the platform kernels take. A call no kernel takes under an
    explicit kernel impl (a pooled cache, soft-capped logits in Pallas) is an error naming why."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} must be one of {IMPLS}")
    if impl == "xla":
        return "xla"
    named = BEST.get(_family(platform)) if impl == "auto" else impl
    if named in PLATFORM_IMPLS and chunk is not None and PLATFORM_IMPLS[named].supports(chunk, softcap) is None:
        return named
    if impl == "auto":
        return "pallas" if named is not None and not pooled and softcap is None else "xla"
    if pooled:
        raise ValueError(f"attention impl={impl!r} has no kernel for a pooled (AdaKV) cache; use impl='auto' or 'xla'")
    if softcap is not None:
        raise ValueError(f"attention impl={impl!r} has no kernel with soft-capped logits (softcap={softcap}); use auto")
    return "pallas"


def _family(platform: str) -> str:
    """jax's platform names as kvjax's: cuda and rocm are GPUs."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform

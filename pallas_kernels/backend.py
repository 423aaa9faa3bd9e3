"""Where a Pallas kernel runs and how it is compiled there: Mosaic on TPU, Triton on GPU, interpret mode
elsewhere (CPU, where Pallas only interprets). A kernel takes `backend=None` (the default device's) or
one of BACKENDS, so that tests can lower it for TPU and GPU from a CPU host."""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("interpret", "tpu", "triton")
# Finite, so a query that sees no key keeps a finite running max (no inf - inf = NaN); its row then has
# zero probability mass and the kernels output zeros for it, as kvjax.ops does.
MASKED = -1e30


def default_backend() -> str:
    """The backend of the default JAX device: tpu, triton (GPU) or interpret (CPU)."""
    platform = jax.default_backend()
    return {"tpu": "tpu", "gpu": "triton", "cuda": "triton", "rocm": "triton"}.get(platform, "interpret")


def resolve(backend: str | None) -> str:
    """`backend`, or the default device's when None; an unknown name is an error."""
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"pallas backend={backend!r} must be one of {BACKENDS}")
    return backend


def call_options(backend: str | None, *, num_warps: int = 4) -> dict:
    """Keyword arguments of `pl.pallas_call` for a backend."""
    backend = resolve(backend)
    if backend == "interpret":
        return {"interpret": True}
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return {"compiler_params": pltpu.CompilerParams()}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=2)}


def padded_group(g: int) -> int:
    """Query heads per KV head, padded to a power of two of at least 16 (Triton's smallest dot operand;
    also a whole number of TPU sublanes). Padded rows are zero queries whose outputs are dropped."""
    return max(16, 1 << (g - 1).bit_length())


def block_size(n: int, largest: int = 128) -> int:
    """A block of n keys or query rows: `largest` (a power of two), or the next power of two >= 16 for
    fewer; the array is padded (with invisible entries) up to a multiple of it."""
    return min(largest, max(16, 1 << (max(n, 1) - 1).bit_length()))


def pad_to(x, axis: int, size: int, value=0):
    """x padded with `value` at the end of `axis` up to `size` (as is when already that long)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def padded_features(x, backend: str | None):
    """x `[..., D]` with D zero-padded to a power of two >= 16 for Triton, which needs power-of-two
    tiles and dot operands of at least 16 (zeros add nothing to a dot product); as is elsewhere."""
    D = x.shape[-1]
    return pad_to(x, -1, max(16, 1 << (D - 1).bit_length()) if resolve(backend) == "triton" else D)

"""Pallas kernels, each beside its pure-jnp reference. Imports only jax.

- `flash_attention`: training and prefill (FlashAttention-2), with a blockwise backward.
- `decode_attention`: one query per row (flash-decoding, split-K); `latent_decode_attention`, MLA's
  absorbed decode through the same kernel.
`kvjax.ops.attention(impl="pallas" | "auto")` dispatches to them.
"""

from pallas_kernels.decode_attention import decode_attention, latent_decode_attention
from pallas_kernels.flash_attention import flash_attention

__all__ = ["decode_attention", "flash_attention", "latent_decode_attention"]

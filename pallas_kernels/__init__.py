"""Pallas kernels, each beside its pure-jnp reference. Imports only jax.

- `flash_attention`: training and prefill (FlashAttention-2), with Pallas backward kernels.
- `decode_attention`: one query per row (flash-decoding, split-K); `latent_decode_attention`, MLA's
  absorbed decode through the same kernel.
- `quant_decode_attention`: decode over int / KIVI codes, dequantized block by block in the kernel.
- `paged_decode_attention`: decode over a pool of pages read through block tables (PagedAttention).
`kvjax.ops.attention(impl="pallas" | "auto")` dispatches to them.
"""

from kvjax.pallas_kernels.decode_attention import decode_attention, latent_decode_attention
from kvjax.pallas_kernels.flash_attention import flash_attention
from kvjax.pallas_kernels.paged_decode_attention import paged_decode_attention

__all__ = ["decode_attention", "flash_attention", "latent_decode_attention", "paged_decode_attention"]

"""`kivi` (Liu et al. 2024, arXiv 2402.02750, sec. 3-4): asymmetric min-max; keys per channel over
groups of `group` tokens, values per token over groups of `min(group, head_dim)` channels. New tokens
go to a full-precision residual; whenever it holds `residual` tokens (a multiple of `group`) they are
quantized as whole groups and the residual empties. Quantized history is never touched again (never
re-quantized from dequantized values)."""

from kvjax.quant.schemes.base import Scheme, register

register(Scheme("kivi", bits=(2, 4), blocked=True, value_grouped=True))

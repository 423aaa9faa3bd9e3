"""`kvquant`, KVQuant-style (Hooper et al. 2024, arXiv 2401.18079, sec. 3): keys quantized per channel
*before* RoPE (the cache un-rotates incoming keys and rotates dequantized ones at each slot's true
position), values per token; the first `sinks` tokens kept in full precision (sec. 3.5); dense and
sparse (sec. 3.4): the ceil(outliers x head_dim) largest magnitudes of each token vector are kept
exactly (value + channel index) and left out of the quantization range. Deviations: min-max uniform
codes with scales computed online per block of `group` tokens (through the same residual as KIVI)
instead of calibrated non-uniform datatypes and per-channel scales; outliers chosen per token vector,
for keys too (KVQuant thresholds keys per channel)."""

from kvjax.quant.schemes.base import Scheme, register

register(Scheme("kvquant", bits=(2, 3, 4), blocked=True, outliers="largest", pre_rope_keys=True, exact_sinks=True))

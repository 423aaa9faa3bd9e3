"""KV quantization: bit packing, group quantizers and the quantized cache (int8/int4, KIVI)."""

from kvjax.quant.cache import QuantKVCache, QuantSpec

__all__ = ["QuantKVCache", "QuantSpec"]

"""KV encodings that keep every token in fewer bytes: bit packing, group quantizers, the quantized cache
(int8/int4, KIVI, KVQuant-style) and Palu-style low-rank caches."""

from kvjax.quant.cache import QuantKVCache, QuantSpec
from kvjax.quant.lowrank import LowRankKVCache, calibrate

__all__ = ["LowRankKVCache", "QuantKVCache", "QuantSpec", "calibrate"]

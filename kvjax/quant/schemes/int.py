"""`int` (the common serving baseline): per token and KV head over head_dim, symmetric (one scale) or,
with `asym`, min-max (a scale and a zero point: the "per-token asymmetric" baseline of KIVI's and
KVQuant's tables); every token is quantized when written. `int:8` is what the engine's pages hold."""

from kvjax.quant.schemes.base import Scheme, register

register(Scheme("int", bits=(4, 8), asym_bits=(2, 4, 8)))

"""`gear` (Kang et al. 2024, arXiv 2403.05527, alg. 1; GEAR-KIVI as its reference `cuda_supported_gear`
runs): KIVI's codes, plus per flushed block of `residual` tokens and KV head a rank-`rank` approximation
Q P^T of the quantization error (power iteration, 3 passes, QR on the last, as the reference's
`fake_poweriteration_group`; P starts from a fixed uniform draw), plus a sparse set of exact outliers:
each token vector's ceil(outliers x head_dim / 2) largest and smallest entries, set to the vector's mean
before quantizing and written back exactly after (the reference's order). Defaults: 2 bits, group and
block 64, outliers 0.02, rank 4. Deviations: outliers per head's token vector for keys and values (the
reference: keys per channel over tokens, values over all heads); one rank for prefill and decode (the
reference lowers it to 2 during decoding); 2^b - 1 levels (the reference's b^2 - 1 equals it at 2 and 4
bits)."""

from kvjax.quant.schemes.base import Scheme, register

register(
    Scheme(
        "gear",
        bits=(2, 4),
        blocked=True,
        value_grouped=True,
        outliers="extremes",
        low_rank=True,
        group=64,
        residual=64,
        outlier_fraction=0.02,
    )
)

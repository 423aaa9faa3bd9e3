"""D2O's scoring (Wan et al. 2024): H2O's accumulated attention with the first 4 positions kept, as its
reference code does; the layer budgets and the merging of evicted tokens are `kvjax.compress.d2o`'s."""

from kvjax.compress.methods.base import register
from kvjax.compress.methods.h2o import H2O


@register
class D2O(H2O):
    name = "d2o"
    sinks = 4

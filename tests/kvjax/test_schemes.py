"""The contract every registered quantizer (`kvjax/quant/schemes/`) keeps, parametrized over the
registry: at each code width it allows, its cache's bytes equal the analytic formula, decoding through
it stays within a few quantization steps of the values written, and a width it does not allow is a
one-line error naming the allowed ones."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.compress import parse_policy
from kvjax.compress.apply import quant_cache_bytes
from kvjax.config import ConfigError
from kvjax.quant import QuantKVCache
from kvjax.quant.schemes import SCHEMES

B, K, H, T, CAPACITY = 2, 2, 16, 37, 48


def _written(name: str, bits: int, asym: bool = False):
    """A cache of small blocks (so that codes, the residual and the low-rank terms all hold tokens)
    after one chunk of T random tokens: (cache, the dequantized keys and values, what was written)."""
    spec = dataclasses.replace(
        parse_policy(f"{name}:{bits}" + (":asym" if asym else "")).stages[0].quant_spec,
        group=4,
        residual=8,
        rope_theta=10_000.0,
    )
    k, v = jax.random.normal(jax.random.key(0), (2, B, T, K, H))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache, view = jax.jit(lambda c, *a: c.update(*a))(
        QuantKVCache.init(spec, B, CAPACITY, K, H, jnp.float32), k, v, pos
    )
    return spec, cache, view, (k, v)


def _widths():
    return [
        (name, bits, asym)
        for name, s in SCHEMES.items()
        for asym in (False, True)
        for bits in (s.asym_bits if asym else s.bits)
    ]


@pytest.mark.parametrize("name, bits, asym", _widths())
def test_every_registered_quantizer_stores_the_bytes_it_declares_and_decodes_close(name, bits, asym):
    spec, cache, view, (k, v) = _written(name, bits, asym)
    positions = cache.pos.shape[1] // cache.capacity if cache.pos.ndim == 3 else 1
    assert cache.nbytes() == B * quant_cache_bytes(spec, cache.capacity, K, H, jnp.float32, positions)
    error = max(
        float(jnp.abs(view.k[:, :, :T].transpose(0, 2, 1, 3) - k).max()),
        float(jnp.abs(view.v[:, :, :T].transpose(0, 2, 1, 3) - v).max()),
    )
    assert error < 4.0 / (2**bits - 1) * 4  # within a few quantization steps of the data's range (|x| < 4)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_registered_quantizer_refuses_a_width_it_does_not_have(name):
    allowed = SCHEMES[name].bits
    with pytest.raises(ConfigError, match=re.escape(f"{name}: bits=7 must be one of {allowed}")):
        parse_policy(f"{name}:7")
    assert np.all(np.diff(allowed) > 0)

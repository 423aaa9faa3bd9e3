"""Next-token sampling: greedy, temperature, top-k and nucleus (top-p), applied in that order."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_REMOVED = -jnp.inf


def _top_k(logits: jax.Array, k: int) -> jax.Array:
    """Keep the k largest logits per row (ties at the k-th value are kept)."""
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, _REMOVED, logits)


def _top_p(logits: jax.Array, p: float) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability reaches p (Holtzman et al. 2020)."""
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < p, sorted_desc, jnp.inf)  # the top token always has mass_before 0
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(logits < threshold, _REMOVED, logits)


def sample(
    logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Draw one token per row of fp32 logits `[B,V]`; temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        logits = _top_k(logits, min(top_k, logits.shape[-1]))
    if top_p < 1.0:
        logits = _top_p(logits, top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)

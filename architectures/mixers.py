"""The mixer module of each layer kind (`kvjax.kinds`), registered by the kind's name in the module that
defines it; `Block` looks its layer's kind up here, so it names no kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

MIXERS: dict[str, Mixer] = {}


@dataclasses.dataclass(frozen=True)
class Mixer:
    """How a layer kind builds its modules. `build(cfg, layer, produces_kv, rngs)` the mixer (called on the
    normed input, it returns output, cache and K/V view); `mlp(cfg, layer, rngs)`, when the kind brings
    its own (RWKV's channel mix, which reads and updates the layer's state), replaces the SwiGLU MLP."""

    build: Callable
    mlp: Callable | None = None


def register_mixer(name: str, build: Callable, mlp: Callable | None = None) -> None:
    if name in MIXERS:
        raise ValueError(f"a mixer for layer kind {name!r} is registered already")
    MIXERS[name] = Mixer(build, mlp)


def common(cfg) -> dict:
    """The initializer scale and parameter dtype every mixer takes."""
    return dict(std=cfg.init_std, dtype=jnp.dtype(cfg.dtype))

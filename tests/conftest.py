"""Test-wide JAX settings (strict rank promotion, an opt-in persistent compilation cache, quick compiles) and shared
model fixtures."""

from __future__ import annotations

import functools
import os

# Tests compile far more than they compute: LLVM at -O0 cut a cold run of tests/kvjax/test_compress.py
# from 121 s to 92 s (same results; XLA's own graph optimizations still run).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if CACHE_DIR := os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # opt-in only: see the Makefile for why
    jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from kvjax.architectures import Decoder  # noqa: E402
from kvjax.config import load_config  # noqa: E402


@functools.cache
def _model(name: str, overrides: tuple[str, ...], seed: int):
    cfg = load_config(name, overrides).model
    return cfg, nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))


@pytest.fixture(scope="session")
def make_model():
    """make_model('gqa', 'model.n_layers=2') -> (ModelConfig, a fresh Decoder); built once per argument set."""

    def make(name: str, *overrides: str, seed: int = 0):
        cfg, (graphdef, state) = _model(name, tuple(overrides), seed)
        return cfg, nnx.merge(graphdef, state)

    return make


def pytest_collection_modifyitems(items):
    """Files holding slow tests first: under pytest-xdist's --dist loadfile (one file per worker at a
    time) the longest files then start early instead of leaving one worker busy alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a file is kept

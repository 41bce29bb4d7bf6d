# One command to set up and run the demo, one to set up and run the tests.
# Setup: a venv in .venv; torch==2.13.0 (CPU wheel) first when no torch is present, so pip
# never pulls a multi-GB CUDA build; then the package with its dev extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetrain-installed

.PHONY: setup demo test test-fast test-slow lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hetrain run

test: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest

# The unit tests without the ones that start processes (subprocesses, gloo ranks, the dist
# engine): a quick check while editing; `make test` stays the CI command.
test-fast: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest -m 'not slow and not multiproc'

test-slow: setup
	$(PY) -m pytest -m slow

# A named, short benchmark set (benchmarks/quick.py's QUICK) into runs/bench/, never into
# benchmarks/results/: a quick look at planner speed and simulated time-to-accuracy.
bench: setup
	$(PY) benchmarks/quick.py

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache

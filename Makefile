# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the pinned lock + the package (editable).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Stable allocator for timing (see docs/BENCHMARKS.md): keep large activation blocks mapped.
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 17179869184
export MALLOC_TOP_PAD_ ?= 1073741824

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements.lock $(wildcard src/leanformer/ops/*.cpp src/leanformer/ops/*.h)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The demo runs on Fashion-MNIST when it is installed; as root with apt-get it installs Debian's
# package first (the four IDX files, 30 MB). Otherwise `leanformer demo` says how to get it and
# runs the digits sweep.
HAVE_FASHION := $(BIN)/python -c "import sys; from leanformer.data.fashion_mnist import is_available; sys.exit(not is_available())"

demo: $(STAMP)
	@$(HAVE_FASHION) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Fashion-MNIST is not installed: installing Debian's package dataset-fashion-mnist (apt-get)"; \
	    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
	      || echo "apt-get could not install dataset-fashion-mnist"; \
	  fi; }
	$(BIN)/leanformer demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m mypy

# The type checker reads its settings (files, libraries without types) from pyproject.toml.
# docs/BENCHMARKS.md must be what benchmarks/results/ render (tools/render_benchmarks.py).
# The tests run in one worker per core (pytest-xdist): most of their time is single-threaded
# Python (graph tracing, small tensors), so a second core halves the suite.
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m mypy
	$(BIN)/python tools/render_benchmarks.py --check
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info

# Ballast: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-all lint protos bench clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to 2.13.0. A local wheel (this machine's pip find-links) is used when there is one;
# otherwise the CPU build comes from PyTorch's CPU index, never the multi-GB CUDA build from PyPI.
# Set TORCH_INDEX_URL to choose another build (e.g. a CUDA index on GPU hosts).
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --no-index --no-deps "torch==2.13.0" 2>/dev/null || \
	  $(PY) -m pip install --quiet --no-deps "torch==2.13.0" --index-url $(TORCH_INDEX_URL)
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# The data dir persists: a second `make demo` is planned with the calibration the first run fitted.
demo: install
	$(VENV)/bin/ballast demo --data-dir .ballast-demo

# `make test` is the everyday suite (ruff + every test not marked slow); `make test-slow` runs the slower
# end-to-end tests; CI (.ci/run) runs both, `make test-all` does too. Both use every core (pytest-xdist, one test
# module per worker, so a module's plane stays in one process) and print their 25 slowest tests; the few slow
# tests whose verdict reads measured speed, or whose plane oversubscribes the cores (marked `alone`), run after
# the others, one at a time.
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile --durations=25

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" $(PYTEST_PARALLEL)

test-slow: install
	$(PY) -m pytest -q -m "slow and not alone" $(PYTEST_PARALLEL)
	$(PY) -m pytest -q -m "slow and alone" --durations=10

test-all: test test-slow

lint: install
	$(VENV)/bin/ruff check .

# Regenerate the committed gRPC/protobuf stubs (tests fail when they are stale).
protos: install
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/ballast/v1/*.proto

# Every benchmark runs even when an earlier one misses its target; the exit status says whether any missed.
bench: install
	@failed=""; for b in benchmarks/*.py; do $(PY) $$b || failed="$$failed $$b"; done; \
	  if [ -n "$$failed" ]; then echo "missed a target or failed:$$failed"; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

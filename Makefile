# replay_service: `make demo` and `make test` bootstrap .venv (Python 3.11) on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The local backend's tests also run under Python 3.12 (no TensorFlow, TF-Agents or dm-reverb
# there); pyenv's 3.12 when it has one, else python3.12 on PATH.
PYTHON312 ?= $(shell p="$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12"; \
  if [ -x "$$p" ]; then echo "$$p"; else command -v python3.12 2>/dev/null; fi)
VENV312 := .venv312
STAMP312 := $(VENV312)/.installed
LOCAL_TESTS := tests/unit/test_portable.py tests/unit/cli/test_stack.py tests/unit/backends/local/test_sum_tree.py tests/integration/backends/local/test_local_backend.py tests/integration/backends/local/test_local_device.py

.PHONY: demo test test-fast test-py312 test-slow lint format benchmark load-test clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: '$(PYTHON)' not found. replay_service needs Python 3.11 (dm-reverb ships wheels only for Linux x86_64 and Python <= 3.11). Install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'." >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || { \
	  echo "error: '$(PYTHON)' is $$($(PYTHON) --version 2>&1), but replay_service needs Python 3.11." >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/replay-demo

# `make test` runs the files on TEST_WORKERS pytest-xdist workers, each file whole on one
# (its module fixtures shared), the system tier first; `TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile
	@$(MAKE) --no-print-directory test-py312

# The fast tier, for the edit-and-test loop: the tests of tests/unit/ and tests/integration/ not
# marked `heavy`, listing its 15 slowest tests. `make test` runs every tier and stays the CI command.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not heavy" --durations=15 -n $(TEST_WORKERS) --dist loadfile tests/unit tests/integration

# Python 3.12, torch path only: the local-backend tests. Without python3.12 this is skipped
# with a warning, except in CI (CI=true), where it fails.
test-py312:
	@if [ -z "$(PYTHON312)" ] || ! "$(PYTHON312)" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then \
	  if [ "$$CI" = "true" ]; then echo "error: Python 3.12 not found (set PYTHON312=...)" >&2; exit 1; fi; \
	  echo "warning: Python 3.12 not found; skipping the Python 3.12 local-backend tests (set PYTHON312=...)" >&2; \
	else $(MAKE) --no-print-directory $(STAMP312) && $(VENV312)/bin/python -m pytest -q -m local $(LOCAL_TESTS); fi

$(STAMP312): pyproject.toml
	@test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --disable-pip-version-check -q -e '.[test]'
	@touch $(STAMP312)

test-slow: $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev,ray]'
	$(BIN)/python -m pytest -q -m slow

# make benchmark BENCH_ARGS="--workloads=atari,sizes --repeats=1"
BENCH_ARGS ?=
benchmark: $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev,bench,atari]'
	$(BIN)/python scripts/benchmark.py $(BENCH_ARGS)

load-test: $(STAMP)
	$(BIN)/python scripts/load_test.py --duration_s=60

lint: $(STAMP)
	$(BIN)/ruff check replay_service scripts tests
	$(BIN)/ruff format --check replay_service scripts tests

format: $(STAMP)
	$(BIN)/ruff format replay_service scripts tests
	$(BIN)/ruff check --fix replay_service scripts tests

clean:
	rm -rf $(VENV) $(VENV312) build *.egg-info .pytest_cache

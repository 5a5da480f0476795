# replay_service: `make demo` and `make test` bootstrap .venv (Python 3.11) on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint format benchmark load-test clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: '$(PYTHON)' not found. replay_service needs Python 3.11 (dm-reverb ships wheels only for Linux x86_64 and Python <= 3.11). Install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'." >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || { \
	  echo "error: '$(PYTHON)' is $$($(PYTHON) --version 2>&1), but replay_service needs Python 3.11." >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m replay_service.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev,ray]'
	$(BIN)/python -m pytest -q -m slow

benchmark: $(STAMP)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[dev]'
	$(BIN)/python scripts/benchmark.py

load-test: $(STAMP)
	$(BIN)/python scripts/load_test.py --duration_s=60

lint: $(STAMP)
	$(BIN)/ruff check replay_service scripts tests
	$(BIN)/ruff format --check replay_service scripts tests

format: $(STAMP)
	$(BIN)/ruff format replay_service scripts tests
	$(BIN)/ruff check --fix replay_service scripts tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

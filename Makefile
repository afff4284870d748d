# Two entry points: `make demo` and `make test`. Both create .venv on first use.
# `make test-matrix` runs the core tests on the oldest and newest supported versions, each in
# a throwaway venv outside the repo (tools/matrix.py, docs/install.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-matrix lint bench conformance clean

$(STAMP): requirements-dev.txt requirements-thirdparty.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-thirdparty.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

test-matrix:
	$(PYTHON) tools/matrix.py

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

conformance: $(STAMP)
	$(BIN)/python tools/conformance.py

clean:
	rm -rf $(VENV)

# Two entry points: `make demo` and `make test`. Both create .venv on first use.
# `make docs` lints the Markdown (`make docs-lint`) and builds the documentation site
# (mkdocs.yml) into site/, every warning an error;
# `make dist` builds and checks the wheel and sdist and runs the quickstart from the wheel;
# `make typecheck` runs mypy on the public API as user code sees it and on examples/.
# `make gpu-check` checks the GPU path on a GPU machine in its own venv (.venv-gpu, from
# requirements-gpu.txt); without a GPU it says so and exits 0. `make gpu-requirements` checks
# that requirements-gpu.txt resolves to one CUDA stack (pip --dry-run; CI runs it).
# `make test-matrix` runs the core tests on the oldest and newest supported versions, one nox
# session each, in venvs kept outside the repo (noxfile.py, docs/install.md); nox is .venv's.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-matrix lint typecheck docs docs-lint dist bench conformance conformance-ci fuzz gpu-check gpu-requirements clean

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
	$(BIN)/vulture src/torchjax tools/vulture_allowlist.py --min-confidence 60 \
		--ignore-names _,tensor_contents --ignore-decorators "@*.defjvp,@*.register_fake"

test: lint
	$(BIN)/python -m pytest -q

typecheck: $(STAMP)
	$(BIN)/mypy

# docs-lint: the pages' Markdown (pymarkdown, configured in .pymarkdown), then what the site's
# renderer reads differently from it (tools/check_markdown.py: a list glued to a paragraph,
# nesting by fewer than 4 spaces, the docstrings the API reference renders).
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build.
docs: docs-lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-lint: $(STAMP)
	$(BIN)/pymarkdown --strict-config --config .pymarkdown scan README.md CHANGELOG.md docs
	$(BIN)/python tools/check_markdown.py

dist: $(STAMP)
	$(BIN)/python tools/check_dist.py

test-matrix: $(STAMP)
	$(BIN)/nox

gpu-check:
	$(PYTHON) tools/gpu_check.py

gpu-requirements:
	$(PYTHON) tools/check_gpu_requirements.py

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

# Every op of torch's OpInfo database under every transform, float64 and float32 with x64
# off, then through lowering="xla"; rewrites docs/conformance.md and fails on any mismatch
# or error, and on a stale entry of CALLBACK_OPS (src/torchjax/_to_jax/_xla/_callback_ops.py).
conformance: $(STAMP)
	$(BIN)/python tools/conformance.py

# CI's share of it (CONTRIBUTING.md): every op under every transform in one of the two
# profiles, and vmap_grad in both; under lowering="xla", every op in the other profile;
# fails on any mismatch or error (a lowered op that disagrees and is not in CALLBACK_OPS).
conformance-ci: $(STAMP)
	$(BIN)/python tools/conformance.py --ci

# The differential program fuzzer (tests/fuzz_suite.py) at length: FUZZ_EXAMPLES random programs
# of composed ops on both lowerings under jit, grad, vmap and jvp, against torch, drawn from a
# random seed it prints (FUZZ_SEED=n draws the same programs again). CI runs a fixed 40 of them
# in make test (derandomized, in a fresh process: tests/test_fuzz.py); a failure prints the shrunk program and a repro.
FUZZ_EXAMPLES ?= 2000
FUZZ_SEED ?= $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
fuzz: $(STAMP)
	TORCHJAX_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TORCHJAX_FUZZ_SEED=$(FUZZ_SEED) \
		$(BIN)/python -m pytest -q tests/fuzz_suite.py -k test_programs_agree_with_torch

clean:
	rm -rf $(VENV) .venv-gpu site dist build

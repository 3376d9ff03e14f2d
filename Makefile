# Two commands matter: `make demo` and `make test`. Both create .venv with pinned versions first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# --no-compile: byte-compiling all of torch was most of the install's time; Python compiles what a run imports
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile
# pytest-xdist workers for `make test` (CI's machine has 2 cores; an idle one takes tests queued for the other, so a
# slow test last in one queue does not hold the run); WORKERS=0 runs in one process
WORKERS ?= 2
# arguments for `make bench`, e.g. ARGS="--head-dims 128 --causal yes"
ARGS ?=

.PHONY: demo test test-all lint bench

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements-dev.txt
	$(PIP) --no-deps -e .
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PIP) -r requirements-bench.txt
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(PY) -m flashtriton demo

# Without a GPU, tests/conftest.py turns on TRITON_INTERPRET=1 so the Triton kernels run on CPU.
# CI's command: all but the tests marked slow (minutes of compiles and processes that test-all and GPU runs take)
test: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal tests

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

bench: $(BENCH_STAMP)
	$(PY) -m flashtriton bench $(ARGS)

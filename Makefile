# Two commands matter: `make demo` and `make test`. Both create .venv with pinned versions first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m flashtriton demo

# Without a GPU, tests/conftest.py turns on TRITON_INTERPRET=1 so the Triton kernels run on CPU.
test: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

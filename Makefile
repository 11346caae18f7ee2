# weightsync — `make demo` and `make test` work on a fresh machine (they run `setup` first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit test-integration protos check-protos lint native bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[trainer,dev]'
	touch $(STAMP)

demo: setup
	$(PY) -m weightsync.demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-integration: setup
	$(PY) -m pytest -q tests/integration

protos: setup
	$(PY) protos/generate.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

native:
	@echo "the native staging shim lands with the trainer-staging work (issue 3); the Python path is used meanwhile"

bench:
	@echo "benchmarks land with the staging and transport work (issues 3 and 5)"

clean:
	rm -rf $(VENV) .weightsync build *.egg-info

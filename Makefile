# Every target creates the virtualenv it needs; only python3 (>= 3.11) must exist.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean venv native

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,vllm,fast,native]' matplotlib tqdm
	touch $(STAMP)

venv: $(STAMP)

## native: compile the router's hot path with mypyc when its sources changed (pure Python if
## the build cannot be done; see kvgate/native.py)
native: $(STAMP)
	$(BIN)/kvgate native build --if-stale

## demo: gateway + router + simulated engines in one process, e2 vs round robin
demo: native
	$(BIN)/kvgate demo

## test: lint, then the whole test suite (real Redis found or started by tests/conftest.py)
test: native
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

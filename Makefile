# Every target creates the virtualenv it needs; only python3 (>= 3.11) must exist.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,vllm,fast]' matplotlib tqdm
	touch $(STAMP)

venv: $(STAMP)

## demo: gateway + router + simulated engines in one process, e2 vs round robin
demo: $(STAMP)
	$(BIN)/kvgate demo

## test: lint, then the whole test suite (real Redis found or started by tests/conftest.py)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

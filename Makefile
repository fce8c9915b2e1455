# The two commands a newcomer needs: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-installs when the server's or the client's dependencies change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml client/pyproject.toml | sha1sum | cut -c1-12)

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/gpucp
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# Two workers (CI has 2 cores; most tests wait on servers more than they compute), the slowest
# tests named at the end so that CI's time stays watched.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25
# What the type checker reads; its settings (strict on the core and the agent) are in pyproject.toml.
MYPY_PATHS := scheduler agents controlplane frontend client/src/gpucp

.PHONY: run test venv lint format services system-deps clean core

$(STAMP): pyproject.toml client/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# The `gpucp` command and SDK (its own distribution, client/): the tests run it.
	$(BIN)/pip install --quiet -e ./client
	rm -f $(VENV)/.installed-*; touch $(STAMP)

venv: $(STAMP)

## Embedded mode: SQLite, in-process scheduling loop, simulated GPU agents, on 127.0.0.1:8000.
run: venv
	$(BIN)/python manage.py embedded

## The scheduling core compiled with mypyc, for the simulator's long replays (scheduler/native.py).
core: venv
	$(BIN)/python scripts/build_core.py

system-deps:
	bash scripts/install-system-deps.sh

services:
	bash scripts/ensure-services.sh

## The whole suite against real PostgreSQL, Redis, Podman and Chromium.
test: venv system-deps services
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy $(MYPY_PATHS)
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy $(MYPY_PATHS)

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) var test-artifacts

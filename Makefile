# The front door. `make stage5` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := models/all-MiniLM-L6-v2
STSB ?= $(wildcard ../shared/data/stsb/sts-dev.csv)
HOST ?= 127.0.0.1
PORT ?= 8000
export HOST PORT

.PHONY: setup model stage0 stage1 stage2 stage3 stage4 stage5 test lint format browser clean

## setup: create .venv, install the project with its build and dev extras, build the model if missing
setup: $(VENV)/.installed $(MODEL_DIR)/manifest.json

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[build,dev]'
	touch $@

$(MODEL_DIR)/manifest.json: | $(VENV)/.installed
	$(MAKE) model

## model: export, quantize and check the model (does nothing when up to date)
model: $(VENV)/.installed
	$(PY) -m common.build_model $(if $(STSB),--stsb $(STSB))

## stage0: embed texts from the command line (ARGS="--bench" for the baseline benchmark)
stage0: setup
	$(PY) -m stage0_script $(ARGS)

stage1 stage2 stage3 stage4 stage5: setup
	$(PY) -m common.serve $@

## browser: Debian's Chromium for the dashboard test (Playwright drives it; nothing is downloaded)
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

## test: the whole suite against the real model, real sockets, real Redis, real browser
test: setup browser
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(VENV)/.installed
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) models site .pytest_cache .mypy_cache .ruff_cache

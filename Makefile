# The front door. `make stage5` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := models/all-MiniLM-L6-v2
# STS-benchmark dev pairs shipped in the repository (data/stsb/README.md); STSB=path for another copy
STSB ?= data/stsb/sts-dev.csv
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
	$(PY) -m stage0_script.build_model $(if $(STSB),--stsb $(STSB))

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

# --- load tests and benchmarks (loadtests/, benchmarks/; docs/benchmarking.md) ---------------
STAGE ?= 5
PROFILE ?= unique-32
DURATION ?= 30
.PHONY: loadtest loadtest-headless loadtest-screenshots compare bench

## loadtest: Locust's web UI on http://127.0.0.1:8089 against HOST:PORT (starts stage STAGE if nothing answers)
loadtest: setup
	$(PY) -m loadtests.run --stage $(STAGE) $(ARGS)

## loadtest-headless: one fixed profile (PROFILE, DURATION s) against stage STAGE; CSV/JSON in out/loadtest/
loadtest-headless: setup
	$(PY) -m loadtests.run --stage $(STAGE) --headless --profile $(PROFILE) --duration $(DURATION) $(ARGS)

## loadtest-screenshots: pictures of Locust's web UI against stage STAGE for docs/benchmarking.md (Chromium)
loadtest-screenshots: setup browser
	$(PY) -m loadtests.ui_screenshot --stage $(STAGE) $(ARGS)

## compare: every stage under the same Locust profiles, then the engine ceiling (QUICK=1: seconds per point)
compare: setup
	$(PY) -m benchmarks.compare $(if $(QUICK),--quick) $(ARGS)

## bench: pytest-benchmark microbenchmarks saved under docs/results/ (COMPARE=1: compare with the last run)
bench: setup
	$(PY) -m pytest benchmarks -o python_files='bench_*.py' -o python_functions='bench_*' -p no:cacheprovider \
		--benchmark-enable --benchmark-only --benchmark-storage=file://docs/results/benchmarks \
		--benchmark-autosave --benchmark-json=docs/results/bench.json \
		$(if $(COMPARE),--benchmark-compare) $(ARGS)
	$(PY) -m benchmarks.micro.report docs/results/bench.json docs/results/bench.md

# --- stage 1 and 2 measurements (docs/stage1.md, docs/stage2.md) ------------------------------
.PHONY: bench-stage2

## bench-stage2: what the API contract costs per request, stage 1 vs 2 under load, the thread sweep (QUICK=1: seconds)
bench-stage2: setup
	$(PY) -m benchmarks.stage2_overhead $(if $(QUICK),--quick)
	$(PY) -m benchmarks.stage2_threads $(if $(QUICK),--quick)

# --- stage 3 measurements (docs/stage3.md) ----------------------------------------------------
.PHONY: bench-stage3

## bench-stage3: stage 3 against stage 2 and the engine, MAX_BATCH_SIZE and window sweeps, padding (QUICK=1: seconds)
bench-stage3: setup
	$(PY) -m benchmarks.stage3 $(if $(QUICK),--quick)

# --- stage 4 measurements (docs/stage4.md) ----------------------------------------------------
.PHONY: bench-stage4

## bench-stage4: cache hit latency by tier, pooled vs per-command Redis, repeated texts and overload vs stage 3
bench-stage4: setup
	$(PY) -m benchmarks.stage4 $(ARGS)

# --- stage 5 measurements (docs/stage5.md) ----------------------------------------------------
.PHONY: stage5-overhead

## stage5-overhead: what metrics, logs and the dashboard cost: stage 5 vs stage 4, same run (QUICK=1: seconds)
stage5-overhead: setup
	$(PY) -m benchmarks.stage5 $(if $(QUICK),--quick) $(ARGS)

# --- docs site and the quantization study (docs/quantization.md, docs/operating.md) -----------
.PHONY: docs docs-build settings-doc quant-study

## docs: serve the tutorial site on http://127.0.0.1:8001 (rebuilds on save)
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve -a 127.0.0.1:8001

## docs-build: build the site strictly into site/ (what the docs test does in a temporary folder)
docs-build: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

## settings-doc: regenerate the settings table of docs/operating.md from common/settings.py
settings-doc: $(VENV)/.installed
	$(PY) -m benchmarks.settings_doc

## quant-study: static INT8 recipes against fp32 and dynamic (docs/results/quantization.json; ~10 min)
quant-study: setup
	$(PY) -m stage0_script.quant_study $(if $(STSB),--stsb $(STSB))

# --- hardening: fuzzing, soak, faults, reliability report (docs/reliability.md) --------------
FUZZ_EXAMPLES ?= 500
SOAK_SECONDS ?= 600
.PHONY: fuzz soak reliability

## fuzz: schemathesis on every stage, batcher properties and the bad-input catalogue, FUZZ_EXAMPLES each
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider \
		tests/test_fuzz_schema.py tests/test_properties_batcher.py tests/test_bad_input.py $(ARGS)

## soak: stage 5 + Redis at 70% of capacity for SOAK_SECONDS (docs/results/soak.json, docs/img/soak.png)
soak: setup
	$(PY) -m benchmarks.reliability.soak --duration $(SOAK_SECONDS)

## reliability: bad input, fuzz and faults against every stage, counted (docs/results/reliability.json)
reliability: setup
	$(PY) -m benchmarks.reliability.reliability $(ARGS)

# --- exercises: build the key piece of stages 2, 3 and 4 yourself (exercises/README.md) -------
# The stage's own tests, run against your file (or, with SOLUTION=1, against the stage itself).
EXERCISE_TESTS_2 := tests/test_event_loop.py tests/test_contract.py tests/test_equivalence.py
EXERCISE_STAGE_2 := stage2_threadpool
.PHONY: exercise

## exercise: run stage STAGE's own tests against exercises/ (SOLUTION=1: against the stage itself)
exercise: setup
	@test -n "$(EXERCISE_TESTS_$(STAGE))" || (echo "STAGE=$(STAGE): exercises exist for stages 2, 3 and 4" >&2; exit 2)
	STAGES=$(if $(SOLUTION),,exercises.)$(EXERCISE_STAGE_$(STAGE)) $(if $(SOLUTION),,EXERCISE=1) \
		$(PY) -m pytest -p no:cacheprovider -q $(if $(SOLUTION),,-x) $(EXERCISE_TESTS_$(STAGE)) $(ARGS)

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

.PHONY: setup model stage0 stage1 stage2 stage3 stage4 stage5 test tools lint format clean

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

# The programs the tests and the measuring kit run, each from Debian's package of the same name
# (nothing is downloaded). `make tools` installs the ones this machine lacks, in one apt-get call;
# tests/test_tools.py checks that every program a test or the kit starts is in this list.
TOOLS := chromium prometheus wrk redis-server
PACKAGES_chromium := chromium fonts-liberation
MISSING_PACKAGES = $(foreach tool,$(TOOLS),$(if $(shell command -v $(tool)),,$(or $(PACKAGES_$(tool)),$(tool))))

## tools: Debian's chromium, prometheus (with promtool), wrk and redis-server, where missing
tools:
	$(if $(strip $(MISSING_PACKAGES)),apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $(strip $(MISSING_PACKAGES)) >/dev/null,@true)

## test: the whole suite against the real model, real sockets, real Redis, real browser
test: setup tools
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

# --- measurements (loadtests/ is the kit, benchmarks/ the experiments; docs/benchmarking.md) ----
# A reader's run writes out/ (git-ignored) and prints its figures beside the committed ones.
# QUICK=1: the short form (seconds per point). RECORD=1: write docs/results/ and docs/img/ (the
# committed evidence), from a clean tree only unless ALLOW_DIRTY=1 (the stamp then says so).
STAGE ?= 5
WEB_PORT ?= 8089
PROFILE ?= unique-32
DURATION ?= 30
EVIDENCE = $(if $(QUICK),--quick) $(if $(RECORD),--record) $(if $(ALLOW_DIRTY),--allow-dirty)
.PHONY: results loadtest loadtest-headless loadtest-screenshots compare bench bench-stage0 bench-stage2 \
	bench-stage3 bench-stage3-refinements bench-stage4 bench-layers before-after \
	dashboard-screenshot quant-study settings-doc evidence-check docs-outputs bench-cost-model

## results: every results file, table and plot the docs include, in order (QUICK=1: briefly, into out/)
results: setup tools
	$(PY) -m benchmarks.results $(EVIDENCE) $(if $(ONLY),--only $(ONLY)) $(if $(FROM),--from $(FROM))

## evidence-check: is docs/results/ current (stamped, clean, today's defaults), and is every prose number in it
evidence-check: $(VENV)/.installed
	$(PY) -m benchmarks.evidence_check

## loadtest: Locust's web UI on port WEB_PORT against HOST:PORT (starts stage STAGE if nothing answers)
loadtest: setup
	$(PY) -m loadtests.run --stage $(STAGE) --web-port $(WEB_PORT) $(ARGS)

## loadtest-headless: one fixed profile (PROFILE, DURATION s) against stage STAGE; CSV/JSON in out/loadtest/
loadtest-headless: setup
	$(PY) -m loadtests.run --stage $(STAGE) --headless --profile $(PROFILE) --duration $(DURATION) $(ARGS)

## loadtest-screenshots: pictures of Locust's web UI against stage STAGE (Chromium; 1-2 min)
loadtest-screenshots: setup tools
	$(PY) -m loadtests.ui_screenshot --stage $(STAGE) $(EVIDENCE) $(ARGS)

## compare: every stage under the same Locust profiles, then the engine ceiling (~45 min; QUICK=1 ~6 min)
compare: setup
	$(PY) -m benchmarks.compare $(EVIDENCE) $(ARGS)

## bench: pytest-benchmark microbenchmarks (~3 min; QUICK=1 ~1 min; COMPARE=1: against your last run)
bench: setup
	$(PY) -m benchmarks.micro $(EVIDENCE) $(if $(COMPARE),--compare) $(ARGS)

## bench-stage0: stage 0's baseline, fp32 against INT8 (~1 min; QUICK=1 seconds)
bench-stage0: setup
	$(PY) -m benchmarks.stage0 $(EVIDENCE) $(ARGS)

## quant-study: static INT8 recipes against fp32 and dynamic (~12 min; QUICK=1 ~3 min)
quant-study: setup
	$(PY) -m benchmarks.quantization $(EVIDENCE) $(if $(STSB),--stsb $(STSB)) $(ARGS)

## bench-stage2: stage 2's thread sweep (~9 min; QUICK=1 ~2 min)
bench-stage2: setup
	$(PY) -m benchmarks.stage2_threads $(EVIDENCE)

## bench-stage3: stage 3 against stage 2 and the engine, batch sizes, the tiers' windows by load (~15 min; QUICK=1 ~4 min)
bench-stage3: setup tools
	$(PY) -m benchmarks.stage3 $(EVIDENCE) $(ARGS)

## bench-stage3-refinements: what each stage 3 refinement changes, through the batcher alone (seconds)
bench-stage3-refinements: setup
	$(PY) -m benchmarks.stage3_refinements $(EVIDENCE) $(ARGS)

## bench-stage4: cache hit latency by tier, pooled vs per-command Redis, repeats, overload, a flood (~5 min; QUICK=1 ~2 min)
bench-stage4: setup tools
	$(PY) -m benchmarks.stage4 $(EVIDENCE) $(ARGS)

## dashboard-screenshot: the stage 5 dashboard after a minute of traffic (Chromium; QUICK=1: 10 s)
dashboard-screenshot: setup tools
	$(PY) -m benchmarks.stage5_screenshot $(EVIDENCE) $(ARGS)

## before-after: the stages of BEFORE (default: before the layout) and of this checkout, in turns (~45 min)
before-after: setup
	$(PY) -m benchmarks.before_after $(EVIDENCE) $(if $(BEFORE),--before $(BEFORE)) $(ARGS)

## bench-layers: what a layer costs a request: stages 1 to 5 in turns under wrk, the engine as yardstick (~12 min; QUICK=1 ~2 min)
bench-layers: setup tools
	$(PY) -m benchmarks.layers $(EVIDENCE) $(ARGS)

## bench-cost-model: the cost model's constants and its prediction for every stage (~2 min; QUICK=1 ~30 s)
bench-cost-model: setup tools
	$(PY) -m benchmarks.cost_model $(EVIDENCE) $(ARGS)

## docs-outputs: what the commands in the chapters print, captured against fresh servers (~2 min)
docs-outputs: setup
	$(PY) -m benchmarks.docs_outputs $(EVIDENCE) $(if $(ONLY),--only $(ONLY)) $(ARGS)

## settings-doc: regenerate the settings table of docs/operating.md from common/settings.py
settings-doc: $(VENV)/.installed
	$(PY) -m benchmarks.settings_doc

# --- docs site (docs/) -------------------------------------------------------------------
.PHONY: docs docs-build

DOCS_PORT ?= 8001

## docs: serve the tutorial site on 127.0.0.1:DOCS_PORT (rebuilds on save)
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve -a 127.0.0.1:$(DOCS_PORT)

## docs-build: build the site strictly into site/ (what the docs test does in a temporary folder)
docs-build: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# --- hardening: fuzzing, soak, faults, reliability report (docs/reliability.md) --------------
FUZZ_EXAMPLES ?= 500
SOAK_SECONDS ?=
.PHONY: fuzz soak reliability

## fuzz: schemathesis on every stage, batcher properties and the bad-input catalogue, FUZZ_EXAMPLES each
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider \
		tests/test_fuzz_schema.py tests/test_properties_batcher.py tests/test_bad_input.py $(ARGS)

## soak: stage 5 + Redis at 70% of capacity for 10 minutes (SOAK_SECONDS=...; QUICK=1: 60 s at 50%)
soak: setup
	$(PY) -m benchmarks.reliability.soak $(EVIDENCE) $(if $(SOAK_SECONDS),--duration $(SOAK_SECONDS)) $(ARGS)

## reliability: bad input, fuzz and faults against every stage, counted (~8 min; QUICK=1 ~5 min)
reliability: setup
	$(PY) -m benchmarks.reliability.reliability $(EVIDENCE) $(ARGS)

# --- exercises: build the key piece of stages 2, 3 and 4 yourself (exercises/README.md) -------
# The stage's own tests, run against your file (or, with SOLUTION=1, against the stage itself).
# Stage 2: the server tests, serving exercises/stage2_threadpool (STAGES).
EXERCISE_TESTS_2 := tests/test_event_loop.py tests/test_contract.py tests/test_equivalence.py
EXERCISE_STAGE_2 := stage2_threadpool
# Stage 3: the batcher tests of the textbook Batcher, not those of the refinements (EXERCISE=1: the
# tests take your Batcher, tests/exercise_pieces.py). EXERCISE_ONLY_N: pytest -k, which of them.
EXERCISE_TESTS_3 := tests/test_batcher.py
EXERCISE_ONLY_3 := (textbook or Batcher-False or Batcher-True or False-Batcher) and not Refined and not Isolated
EXERCISE_STAGE_3 := stage3_batching
# Stage 4: the LRU's tests, then stage 4's backend holding your LRU, single-flight and admission check
# (all its tests but the drain's).
EXERCISE_TESTS_4 := tests/test_stage4_cache.py tests/test_stage4_backend.py
EXERCISE_ONLY_4 := lru or (test_stage4_backend and not drain)
EXERCISE_STAGE_4 := stage4_cache_backpressure
.PHONY: exercise

## exercise: run stage STAGE's own tests against exercises/ (SOLUTION=1: against the stage itself)
exercise: setup
	@test -n "$(EXERCISE_TESTS_$(STAGE))" || (echo "STAGE=$(STAGE): exercises exist for stages 2, 3 and 4" >&2; exit 2)
	STAGES=$(if $(SOLUTION),,exercises.)$(EXERCISE_STAGE_$(STAGE)) $(if $(SOLUTION),,EXERCISE=1) \
		$(PY) -m pytest -p no:cacheprovider -q $(if $(SOLUTION),,-x) $(EXERCISE_TESTS_$(STAGE)) \
		$(if $(EXERCISE_ONLY_$(STAGE)),-k "$(EXERCISE_ONLY_$(STAGE))") $(ARGS)

# --- beyond one machine: Ray Serve across nodes, the image, the fleet (docs/beyond.md) ----------
.PHONY: cluster cluster-down cluster-status bench-cluster

# Ray is an optional extra: only these targets (and the cluster tests) install it.
$(VENV)/.cluster: pyproject.toml | $(VENV)/.installed
	$(PY) -m pip install -q -e '.[cluster]'
	touch $@

## cluster: two Ray nodes here (head + worker), stage 5 on Ray Serve with one replica a node, on HOST:PORT
cluster: setup $(VENV)/.cluster
	$(PY) -m deploy.ray.cluster up

## cluster-down: stop Serve (every replica drains), then every process of the cluster
cluster-down:
	$(PY) -m deploy.ray.cluster down

## cluster-status: the nodes, the replicas and the address of the running cluster
cluster-status:
	$(PY) -m deploy.ray.cluster status

## bench-cluster: the cluster (1 and 2 replicas) against plain stage 5: capacity, CPU a request, a flood (~6 min)
bench-cluster: setup $(VENV)/.cluster
	$(PY) -m benchmarks.beyond $(EVIDENCE) $(ARGS)

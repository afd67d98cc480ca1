# The front door. `make stage5` and `make test` set everything up on a fresh machine; `make help`
# lists every target. Knobs (QUICK=1, RECORD=1, STAGE=, ONLY=, ...) instead of one target a variant.
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

.DEFAULT_GOAL := help
.PHONY: help setup model stage0 stage1 stage2 stage3 stage4 stage5 loadtest clean test tools lint fuzz exercise

# `make help`: the lines that start with `##` (a target) under those that start with `#>` (a group).
help:
	@awk '/^#> /{printf "\n%s\n", substr($$0, 4)} \
		/^## /{line = substr($$0, 4); i = index(line, ": "); \
		printf "  %-16s %s\n", substr(line, 1, i - 1), substr(line, i + 2)}' $(MAKEFILE_LIST)

#> run: set up, serve a stage, load it
## setup: create .venv, install the project with its build and dev extras, build the model if missing
setup: $(VENV)/.installed $(MODEL_DIR)/manifest.json

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[build,dev]'
	touch $@

# The build's recipe (BUILD_VERSION) lives in build_model.py: a change there reruns `make model`,
# which rebuilds only when the recipe or the checkpoint changed.
$(MODEL_DIR)/manifest.json: stage0_script/build_model.py | $(VENV)/.installed
	$(MAKE) model
	touch $@

## model: export, quantize and check the model (does nothing when up to date)
model: $(VENV)/.installed
	$(PY) -m stage0_script.build_model $(if $(STSB),--stsb $(STSB))

## stage0 .. stage5: stage 0 embeds ARGS="some text" (ARGS=--bench: its baseline); 1-5 serve on HOST:PORT
stage0: setup
	$(PY) -m stage0_script $(ARGS)

stage1 stage2 stage3 stage4 stage5: setup
	$(PY) -m common.serve $@

STAGE ?= 5
WEB_PORT ?= 8089
PROFILE ?= unique-32
DURATION ?= 30
## loadtest: Locust's web UI on WEB_PORT against HOST:PORT, starting stage STAGE if nothing answers (HEADLESS=1: PROFILE for DURATION s, files in out/loadtest/; COMPARE=3,4: those stages side by side, a user class each)
loadtest: setup
	$(PY) -m loadtests.run --stage $(STAGE) --web-port $(WEB_PORT) $(if $(COMPARE),--compare $(COMPARE)) \
		$(if $(HEADLESS),--headless --profile $(PROFILE) --duration $(DURATION)) $(ARGS)

## clean: remove .venv, the model and every cache
clean:
	rm -rf $(VENV) models site .pytest_cache .mypy_cache .ruff_cache

#> test: the suite and its checks
# The programs the tests and the measuring kit run, from Debian's packages (nothing is downloaded).
# When any is missing, one apt-get call installs them all (it skips those already there);
# tests/test_tools.py checks that every program a test or the kit starts is installed here.
## tools: Debian's chromium, prometheus (with promtool), wrk, redis-server, buildah and debootstrap, where missing
tools:
	@for tool in chromium prometheus promtool wrk redis-server buildah debootstrap; do \
		command -v $$tool >/dev/null || missing=1; done; \
	test -z "$$missing" || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends chromium fonts-liberation prometheus wrk redis-server buildah debootstrap >/dev/null)

## test: the whole suite against the real model, real sockets, real Redis, real browser
test: setup tools
	$(PY) -m pytest

## lint: ruff (check and format) and mypy (FIX=1: reformat and fix what ruff can first)
lint: $(VENV)/.installed
	$(if $(FIX),$(PY) -m ruff format . && $(PY) -m ruff check --fix .)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

FUZZ_EXAMPLES ?= 500
## fuzz: schemathesis on every stage, batcher properties and the bad-input catalogue, FUZZ_EXAMPLES each
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider \
		tests/test_fuzz_schema.py tests/test_properties_batcher.py tests/test_bad_input.py $(ARGS)

# --- exercises: build the key piece of every stage yourself (exercises/README.md) -------------
# The stage's own tests, run against your file (or, with SOLUTION=1, against the stage itself).
# Stage 0: the engine's tests, taking your Engine and l2_normalize (EXERCISE=1,
# tests/exercise_pieces.py); the first names what is still to write.
EXERCISE_TESTS_0 := tests/test_engine.py
EXERCISE_STAGE_0 := stage0_script
# Stages 1 and 2: the server tests, serving exercises/stageN_* (STAGES); the first names the TODO
# (stage 1 has no pool: its in-process pool test is left out).
EXERCISE_TESTS_1 := tests/test_event_loop.py tests/test_contract.py tests/test_equivalence.py
EXERCISE_ONLY_1 := not the_pool_runs
EXERCISE_STAGE_1 := stage1_naive
EXERCISE_TESTS_2 := tests/test_event_loop.py tests/test_contract.py tests/test_equivalence.py
EXERCISE_STAGE_2 := stage2_threadpool
# Stage 3: the batcher tests of the textbook Batcher, not those of the refinements (EXERCISE=1: the
# tests take your Batcher, tests/exercise_pieces.py). The first sends one request through every
# method you write and names the first one still to write. EXERCISE_ONLY_N: pytest -k, which of them.
# A stuck test (a loop that never awaits, a future never resolved) stops after this many seconds,
# named by pytest-timeout, instead of the suite's 5 minutes.
EXERCISE_TIMEOUT_S ?= 60
EXERCISE_TESTS_3 := tests/test_batcher.py
EXERCISE_ONLY_3 := (textbook or Batcher-False or Batcher-True or False-Batcher) and not Refined and not Isolated
EXERCISE_STAGE_3 := stage3_batching
# Stage 4: the LRU's tests, then stage 4's backend holding your LRU, single-flight and admission check
# (all its tests but the drain's).
EXERCISE_TESTS_4 := tests/test_stage4_cache.py tests/test_stage4_backend.py
EXERCISE_ONLY_4 := lru or (test_stage4_backend and not drain)
EXERCISE_STAGE_4 := stage4_cache_backpressure
# Stage 5: your backend's counting, in-process first (the on_batch hook, then a request), then a server
# of your file (STAGES, EXERCISE=1: tests/exercise_pieces.py) scraped after known traffic.
EXERCISE_TESTS_5 := tests/test_stage5_units.py tests/test_stage5_metrics.py
EXERCISE_ONLY_5 := the_backend_counts or scrape_counts or deadline_rejection or cache_saving or request_log_lines
EXERCISE_STAGE_5 := stage5_metrics

## exercise: run stage STAGE's own tests against exercises/ (SOLUTION=1: against the stage itself)
exercise: setup
	@test -n "$(EXERCISE_TESTS_$(STAGE))" || (echo "STAGE=$(STAGE): exercises exist for stages 0 to 5" >&2; exit 2)
	STAGES=$(if $(SOLUTION),,exercises.)$(EXERCISE_STAGE_$(STAGE)) $(if $(SOLUTION),,EXERCISE=1) \
		$(PY) -m pytest -p no:cacheprovider -q $(if $(SOLUTION),,-x) --timeout=$(EXERCISE_TIMEOUT_S) \
		$(EXERCISE_TESTS_$(STAGE)) \
		$(if $(EXERCISE_ONLY_$(STAGE)),-k "$(EXERCISE_ONLY_$(STAGE))") $(ARGS)

#> measure: the evidence the chapters quote (docs/benchmarking.md)
# loadtests/ is the kit, benchmarks/ the experiments. A reader's run writes out/ (git-ignored) and
# prints its tables (the committed ones are in docs/results/). QUICK=1: the short form (seconds per point).
# RECORD=1: write docs/results/ and docs/img/ (the committed evidence), from a clean tree only
# unless ALLOW_DIRTY=1 (the stamp then says so).
EVIDENCE = $(if $(QUICK),--quick) $(if $(RECORD),--record) $(if $(ALLOW_DIRTY),--allow-dirty)
SOAK_SECONDS ?=
.PHONY: results compare bench soak evidence-check

# Ray is an optional extra: only the cluster, its benchmark (the results step `beyond`) and the
# cluster tests install it.
$(VENV)/.cluster: pyproject.toml | $(VENV)/.installed
	$(PY) -m pip install -q -e '.[cluster]'
	touch $@
# A listing (LIST=1) runs nothing: it needs the venv only, not the tools, the model or Ray.
NEEDS_CLUSTER = $(if $(LIST),,$(if $(ONLY),$(findstring beyond,$(ONLY)),yes))

## results: every results file, table and picture the docs include, in order (ONLY=stage3,soak: some steps; FROM=step: from there on; LIST=1: the steps and their estimates)
results: $(if $(LIST),$(VENV)/.installed,setup tools) $(if $(NEEDS_CLUSTER),$(VENV)/.cluster)
	$(PY) -m benchmarks.results $(EVIDENCE) $(if $(ONLY),--only $(ONLY)) $(if $(FROM),--from $(FROM)) \
		$(if $(LIST),--list) $(ARGS)

## compare: every stage in turns under the same Locust loads (wrk beside it on two), each against the one before, and the engine alone (AGAINST=commit: that commit's stages and this checkout's, in turns)
compare: setup tools
	$(PY) -m benchmarks.compare $(EVIDENCE) $(if $(AGAINST),--against $(AGAINST)) $(ARGS)

## bench: pytest-benchmark microbenchmarks (COMPARE=1: against your last run)
bench: setup
	$(PY) -m benchmarks.micro $(EVIDENCE) $(if $(COMPARE),--compare) $(ARGS)

## soak: stage 5 + Redis, open loop at 70% of capacity for 3.5 minutes (SOAK_SECONDS=3600: an hour; QUICK=1: 60 s at 50%)
soak: setup
	$(PY) -m benchmarks.soak $(EVIDENCE) $(if $(SOAK_SECONDS),--duration $(SOAK_SECONDS)) $(ARGS)

## evidence-check: is docs/results/ current (stamped, clean, today's defaults), and is every prose number in it
evidence-check: $(VENV)/.installed
	$(PY) -m benchmarks.evidence_check

#> deploy: beyond one machine, an image and Ray Serve across nodes (docs/beyond.md)
.PHONY: image cluster cluster-down cluster-status

## image: the stage 5 image of deploy/docker/Dockerfile, kept while its files are unchanged (docker where an engine runs, else buildah on Debian's packages; RUN=1: serve it on PORT)
image: $(VENV)/.installed tools
	$(PY) -m deploy.docker.image $(if $(RUN),run,build)

## cluster: two Ray nodes here (head + worker), stage 5 on Ray Serve with one replica a node, on HOST:PORT
cluster: setup $(VENV)/.cluster
	$(PY) -m deploy.ray.cluster up

## cluster-down: stop Serve (every replica drains), then every process of the cluster
cluster-down:
	$(PY) -m deploy.ray.cluster down

## cluster-status: the nodes, the replicas and the address of the running cluster
cluster-status:
	$(PY) -m deploy.ray.cluster status

#> docs: the tutorial site (docs/)
.PHONY: docs
DOCS_PORT ?= 8001

## docs: serve the tutorial site on 127.0.0.1:DOCS_PORT, rebuilding on save (BUILD=1: build it strictly into site/)
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs $(if $(BUILD),build --strict,serve -a 127.0.0.1:$(DOCS_PORT))

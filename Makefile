# The two commands the README starts with.
#   make demo   set up .venv (CPU or GPU extra) and tune the embedded default on the sample trace
#   make test   set up .venv and run the whole test suite (what CI runs)
# and, for the edit loop and the record:
#   make test-fast    every test that needs no vLLM engine, no PostgreSQL and is not slow (< 4 min on 2 cores)
#   make reliability  run the reliability scenarios and rewrite results/reliability.{json,md}
PY := .venv/bin/python
WORKLOAD ?= workloads/samples/translation_trace.jsonl
# Set up once: scripts/setup.sh runs again only when .venv is missing or older than what it
# installs from (delete .venv, or `make setup-force`, to reinstall from scratch).
STAMP := .venv/.autotune-setup-done
# Two pytest workers (this is a 2-core machine) for each phase: first the tests without an
# engine, then the engine and PostgreSQL tests, two at a time too (most of an engine test's time
# is the engine's start and windows replayed at the recorded pace, so two side by side take
# about half the time: 14.1 min for the 55 tests of 2026-11-25 here, against 31.3 min one at a
# time in the last CI run; each engine reserves at most 0.3 of RAM, so two fit). The tests that
# start the most engines go first (tests/conftest.py), so the short ones fill the gaps.
WORKERS ?= 2
LINT := $(PY) -m ruff check autotune server workloads tests benchmarks scripts

.PHONY: setup setup-force demo test test-fast lint reliability

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

setup-force:
	rm -f $(STAMP)
	$(MAKE) setup

demo: setup
	$(PY) -m autotune run --workload $(WORKLOAD)

lint: setup
	$(LINT)

test: setup
	$(LINT)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup -m "not engine and not postgres"
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup -m "engine or postgres"

test-fast: setup
	$(PY) -m pytest -q -n $(WORKERS) -m "not engine and not postgres and not slow"

reliability: setup
	$(PY) -m pytest -q -m reliability --reliability-dir results

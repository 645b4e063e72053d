# The two commands the README starts with.
#   make demo   set up .venv (CPU or GPU extra) and tune the embedded default on the sample trace
#   make test   set up .venv and run the test suite (what CI runs)
PY := .venv/bin/python
WORKLOAD ?= workloads/samples/translation_trace.jsonl

.PHONY: setup demo test lint

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m autotune run --workload $(WORKLOAD)

lint: setup
	$(PY) -m ruff check autotune server workloads tests benchmarks scripts

test: setup
	$(PY) -m ruff check autotune server workloads tests benchmarks scripts
	$(PY) -m pytest -q

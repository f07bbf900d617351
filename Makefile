# vllm-specstream: the two commands the README starts with, and their setup.
VENV := .venv
BIN := $(VENV)/bin
export PYTHONUNBUFFERED := 1

.PHONY: setup base demo demo-adapter suffix-decoding test test-fast lint clean-venv

setup:  ## create .venv and install everything (idempotent; seconds when done)
	@bash scripts/setup.sh

base: setup  ## convert the embedded SmolLM2-135M-Instruct once (cached)
	@$(BIN)/specstream prepare-base

demo: base  ## specstream end to end: a real-task adapter on the embedded model, plain vs specstream
	@$(BIN)/python examples/demo.py

# The suite's files run on three workers (one file's tests stay together: they share engines),
# engine-heavy files first (tests/helpers.py: LONGEST_FIRST). Each engine computes on one
# thread (tests/conftest.py) and waits on process starts and imports part of the time, so
# three at a time keep a 2-core machine busier than two (docs/testing.md).
test: setup base  ## the whole suite, engine tests included (what CI runs)
	@$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=15 tests

test-fast: setup  ## unit tests only (no vLLM engine)
	@$(BIN)/python -m pytest -q -m "not engine and not serve" tests

lint: setup
	@$(BIN)/ruff check vllm_specstream tests examples benchmarks
	@$(BIN)/ruff format --check vllm_specstream tests examples benchmarks
	@$(BIN)/lint-imports --no-cache

clean-venv:
	rm -rf $(VENV)

demo-adapter: base  ## retrain the demo SQL adapter and its ntp baseline (~1-2 h on 2 cores)
	@bash scripts/demo_adapter.sh runs

suffix-decoding: setup  ## build arctic-inference's suffix tree: vLLM's suffix method (bench) and suffix drafts beside the streams
	@bash scripts/suffix_decoding.sh

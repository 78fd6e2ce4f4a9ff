# The two commands of the README:  `make run` (serve the default model)  and  `make test`.
# Both create .venv, install the project and pull the default model first; a second run skips
# whatever is already done.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed-stamp
MODEL := smollm2-135m-instruct
CHECKPOINT := checkpoints/$(MODEL)/model.toml

.PHONY: setup pull run generate test

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python -m orca_jax.native  # the native CPU attention kernel (g++); says so if it cannot
	touch $@

pull: $(CHECKPOINT)

$(CHECKPOINT): | $(INSTALLED)
	$(BIN)/orca-jax pull $(MODEL)

# The main job: the OpenAI-compatible server on the default model, http://127.0.0.1:8000 (Ctrl-C
# drains and stops it). HOST/PORT override the address. It serves the model's own Q4_1 blocks
# (`gguf`: 2.1-2.5x float32's speed for one request, level or ahead under load, 5.5x less memory;
# docs/quantization.md); QUANTIZATION=none serves float32, the fidelity reference.
HOST ?= 127.0.0.1
PORT ?= 8000
QUANTIZATION ?= gguf
run: setup pull
	$(BIN)/orca-jax serve --model $(MODEL) --quantization $(QUANTIZATION) --host $(HOST) --port $(PORT)

# A batch of chat prompts through the offline engine (continuous batching, chunked prefill).
generate: setup pull
	$(BIN)/orca-jax generate --model $(MODEL) --quantization $(QUANTIZATION) --chat --max-tokens 64 \
		--policy chunked --max-num-seqs 16 --max-num-batched-tokens 256 \
		"What is the capital of France?" \
		"Write a haiku about the sea." \
		"Name three primary colors." \
		"Explain what a hash table is in two sentences." \
		"Give me a Python function that reverses a string." \
		"What causes the seasons on Earth?" \
		"Suggest a name for a friendly robot." \
		"Translate 'good morning' into French and Spanish."

test: setup pull
	$(BIN)/python -m pytest -q tests

# The edit loop's subset: the tiny models only (no SmolLM2: `slow`), in this one process (no CLI
# runs, servers, multi-host jobs: `multiprocess`), without the modules that compile engines in many
# configurations, Pallas in interpret mode or XLA's attention kernel alone (`heavy`); markers set by
# tests/conftest.py and the kernel tests. `make test` stays the whole suite.
.PHONY: test-fast
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not multiprocess and not heavy and not installed and not gpu" tests

# The documentation site (site/): README's headline table in step with bench/results/latest/,
# `mkdocs build --strict` (a broken link or anchor, a page left out fails it), then every example
# marked runnable in README.md and docs/ against the tiny model (docs/run_examples.py).
DOCS_INSTALLED := $(VENV)/.docs-installed-stamp
.PHONY: docs
docs: setup $(DOCS_INSTALLED)
	$(BIN)/python docs/gen_performance.py --check-readme
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet  # (without the theme's notice of its successor)
	$(BIN)/python docs/run_examples.py

$(DOCS_INSTALLED): pyproject.toml | $(INSTALLED)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

# The GPU run (bench/gpu_run.sh) here on CPU at tiny shapes, with gguf and llguidance unimportable as
# on the GPU image: what it wrote is in build/gpu-dry-run/.
.PHONY: gpu-dry-run
gpu-dry-run: setup
	PYTHON=$(BIN)/python bench/gpu_run.sh --smoke build/gpu-dry-run

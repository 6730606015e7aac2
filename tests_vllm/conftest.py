"""The vLLM tests (``make test-vllm``, in the vLLM venv). Each engine runs in its own process
(``engine.py``); the past-the-window reference comes from the main venv (``make_reference.py``), its
path in ``QSINKKV_VLLM_REFERENCE`` (``make test-vllm`` writes it first)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# vLLM's CUDA build (the vLLM 0.34 lane, ``make test-vllm034``) on a machine without a GPU: its CUDA platform comes
# from the test-only platform plugin in cuda_standin/ (a stand-in driver library, device queries answered as an
# H100's), on this process's path and its children's. The files that run a model need vLLM's CPU build here.
CUDA_STANDIN = HERE / "cuda_standin"
sys.path.insert(0, str(CUDA_STANDIN))
from qsinkkv_cuda_standin import cuda_build  # noqa: E402

CUDA_BUILD = cuda_build()
if CUDA_BUILD:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CUDA_STANDIN), os.environ.get("PYTHONPATH"))))
    collect_ignore = ["test_vllm_cpu_prefill.py", "test_vllm_hybrid.py", "test_vllm_load.py", "test_vllm_plugin.py",
                      "test_vllm_recall.py", "test_vllm_server.py", "test_vllm_touchpoints.py"]
else:
    sys.path.remove(str(CUDA_STANDIN))
# qsinkkv's Triton kernels (the plugin's CUDA path, tests_vllm/test_vllm_layer.py) run in Triton's interpreter here;
# set before any of them is imported. The engines run_engine starts are CPU engines: they do not get it.
os.environ.setdefault("TRITON_INTERPRET", "1")


def run_engine(spec: dict, timeout: int = 420) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run([sys.executable, str(HERE / "engine.py"), json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("QSINKKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"engine.py gave no result (rc {p.returncode}):\n{p.stderr[-4000:]}")


@pytest.fixture(scope="session")
def reference() -> dict:
    path = os.environ.get("QSINKKV_VLLM_REFERENCE")
    if not path or not Path(path).exists():
        pytest.fail("QSINKKV_VLLM_REFERENCE must name the JSON made by tests_vllm/make_reference.py in the main venv "
                    "(make test-vllm does this)")
    with open(path) as f:
        return json.load(f)["runs"]

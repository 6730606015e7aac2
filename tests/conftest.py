import os

import pytest
import torch

# Triton kernels run natively on CUDA; elsewhere under Triton's interpreter on the CPU.
# The variable must be set before triton.jit decorates the kernels (at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers) each worker takes its share of the cores: two PyTorch
# thread pools of all the cores would oversubscribe them (their OpenMP workers spin)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes the kernels' dots in float32; on a GPU they use tf32 tensor cores.
KERNEL_TOL = 1e-5 if DEVICE == "cpu" else 3e-3


# --- markers: `make test-fast` runs -m "not model and not slow" --------------------------------------------------

def pytest_configure(config):
    config.addinivalue_line("markers", "model: loads a real model (the default SmolLM2-135M-Instruct, or Gemma 3 270M "
                                       "in tests/test_gemma3_model.py): the default_model fixture or a fixture built "
                                       "on it, load_model, qsinkkv-eval on the model")
    config.addinivalue_line("markers", "slow: takes more than ~5 s on 2 CPU cores without loading the model")


def pytest_collection_modifyitems(config, items):
    """Every test that uses the real model through a fixture (``default_model``, directly or through
    ``model_tok`` or another fixture built on it) is marked ``model``; tests that load it themselves say so."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


# --- the real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def default_model():
    """The default model's folder (converted from the GGUF on first use). Every fixture that loads the real
    model asks for it, so that its tests are marked ``model``."""
    from qsinkkv.models import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="module")
def model_tok(request, default_model):
    """(model, tokenizer): the real default model, loaded once per test file that asks (``--dist loadfile`` keeps a
    file on one worker), in the file's ``MODEL_DTYPE`` (float32 unless it says) and with its ``MODEL_ATTN``:
    "replay" (unless it says) as the eval loads it (``qsinkkv.eval.data.load``: sdpa, then the replay attention),
    None for transformers' default, or an ``attn_implementation`` to load with."""
    dtype = getattr(request.module, "MODEL_DTYPE", torch.float32)
    attn = getattr(request.module, "MODEL_ATTN", "replay")
    if attn == "replay":
        from qsinkkv.eval import data
        return data.load(None, "cpu", dtype)
    from qsinkkv.models import load_model
    return load_model(dtype=dtype, attn_implementation=attn)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp

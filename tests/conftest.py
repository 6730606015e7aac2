import os

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

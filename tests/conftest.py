import os

import torch

# Triton kernels run natively on CUDA; elsewhere under Triton's interpreter on the CPU.
# The variable must be set before triton.jit decorates the kernels (at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes the kernels' dots in float32; on a GPU they use tf32 tensor cores.
KERNEL_TOL = 1e-5 if DEVICE == "cpu" else 3e-3

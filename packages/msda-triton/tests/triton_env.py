import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The kernels run on the GPU when there is one, else on CPU tensors through Triton's interpreter.
DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)

needs_kernels = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (runs in nox -s gpu)")

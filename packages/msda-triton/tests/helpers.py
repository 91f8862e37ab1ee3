"""What the kernel tests (test_kernels.py) and the GPU tests (test_gpu.py) share: the dtype variants, the crowded
case and the parity check against float64."""

import msda_testkit as kit
import torch
from triton_env import DEVICE

REFERENCE = "naive" if DEVICE == "cpu" else "grid_sample"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (value dtype, location/weight dtype, grad_accum)
VARIANTS = [(F32, F32, "native"), (F32, F32, "fp32"), (F16, F16, "native"), (F16, F16, "fp32"),
            (BF16, BF16, "fp32"), (BF16, BF16, "native"), (F16, F32, "native"), (BF16, F32, "auto")]


def _id(variant):
    dtype, loc_dtype, acc = variant
    name = str(dtype)[6:] + ("" if loc_dtype == dtype else "-" + str(loc_dtype)[6:] + "-locations")
    return f"{name}-{acc}"


def assert_triton_parity(inputs, grad_accum, deterministic=False):
    """The Triton backend against float64 (kit.assert_parity: grad_value judged by the entry of the path that ran)."""
    return kit.assert_parity(inputs, "triton", REFERENCE, grad_accum=grad_accum, deterministic=deterministic)


# many queries on one 2x2 map: hundreds of atomic adds land on each element of grad_value
CROWDED = kit.Case("crowded", queries=200, heads=1, head_dim=8, levels=((2, 2),), points=2)

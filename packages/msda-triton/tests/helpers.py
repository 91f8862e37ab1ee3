"""What the kernel tests (test_kernels.py) and the GPU tests (test_gpu.py) share: the dtype variants, the crowded
case, the parity check against float64 and the wrong level table."""

import msda_testkit as kit
import torch
from msda_testkit import conformance
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


CROWDED = conformance.CROWDED  # many queries on one 2x2 map: hundreds of atomic adds on each element of grad_value


def wrong_level_table(inputs):
    """``inputs`` with a level table claiming 40 rows where value has 30 (level 1 reaching past value's end: not
    validated on the GPU), and what the kernels must give for it: a level not inside value's rows contributes
    nothing (kernels._level_inside), so the reference on level 0 alone, with zero gradients for level 1."""
    wrong = dict(inputs, spatial_shapes=torch.tensor([[6, 4], [4, 4]], device=inputs["value"].device),
                 level_start_index=torch.tensor([0, 24], device=inputs["value"].device))
    level_0 = dict(wrong, value=inputs["value"][:, :24], spatial_shapes=wrong["spatial_shapes"][:1],
                   level_start_index=wrong["level_start_index"][:1],
                   sampling_locations=inputs["sampling_locations"][:, :, :, :1],
                   attention_weights=inputs["attention_weights"][:, :, :, :1])
    return wrong, level_0

"""The knot convention (msda_testkit.knots) on the Triton kernels: at Deformable DETR's initialisation, where
encoder samples sit on knots (exact ones on power-of-two levels, fp32's near ones elsewhere), the output and
gradients equal the compiled extension's arithmetic (x = loc * W - 0.5 rounded twice in fp32, x0 = floor(x), the
derivative towards the higher pixel).

Compiled for a GPU, Triton would fuse the product and the difference into one fma.rn.f32 (one rounding: 36 of
4080 coordinates here took the other side), so _corners makes the product with libdevice.mul_rn, never fused
(kernels.ROUNDED_PRODUCT; test_compile_ptx checks the PTX); the interpreter computes the plain product, the same
number."""

import pytest
import torch
from msda_testkit import knots
from triton_env import DEVICE, needs_kernels

pytestmark = needs_kernels

@pytest.mark.parametrize("levels", [((8, 8), (4, 2)), ((6, 10), (3, 5))],
                         ids=["powers_of_two", "other_sizes"])
def test_triton_follows_the_extension_at_knots(levels):
    inputs = knots.model_init_inputs(levels, dtype=torch.float32)
    knots.assert_follows_the_extension("triton", {k: v.to(DEVICE) for k, v in inputs.items()})

"""torch.library.opcheck of both public ops with the Triton backend over every edge case: the autograd registration
and the fake-tensor kernel, and on the GPU the schema (no mutation or aliasing it does not declare; it runs each op
several times, minutes under Triton's interpreter). The AOT dispatch check, which compiles, runs in
test_kernels.test_opcheck (on the GPU; Triton's interpreter cannot be traced)."""

import msda_testkit as kit
import pytest
import torch
from triton_env import DEVICE, needs_kernels

pytestmark = needs_kernels
CHECKS = ("test_autograd_registration", "test_faketensor") + (("test_schema",) if DEVICE == "cuda" else ())


@pytest.mark.parametrize("case", kit.EDGE_CASES, ids=lambda c: c.name)
def test_opcheck_both_ops(case):
    inputs = kit.make_inputs(case, torch.float32, device=DEVICE)
    grad = kit.grad_output_for(inputs)
    detached = tuple(inputs.values())
    for k in kit.DIFFERENTIABLE:
        inputs[k] = inputs[k].detach().requires_grad_()
    options = {"backend": "triton"}
    torch.library.opcheck(torch.ops.msda.deform_attn.default, tuple(inputs.values()), options, test_utils=CHECKS)
    torch.library.opcheck(torch.ops.msda.deform_attn_backward.default, (grad, *detached),
                          {**options, "grad_accum": "auto", "deterministic": None}, test_utils=CHECKS)

"""mmcv's formulation is the op: the same output and gradients as float64 naive."""

import msda_testkit as kit
import pytest
import torch


@pytest.mark.parametrize("case", [kit.case("out_of_bounds"), kit.case("decoder_small")], ids=lambda c: c.name)
def test_mmcv_pytorch_matches_float64(case):
    """The CPU baseline is the op: mmcv's formulation computes the same output and gradients."""
    inputs = kit.make_inputs(case, torch.float64)
    leaves = {k: v.requires_grad_() if k in kit.DIFFERENTIABLE else v
              for k, v in kit.make_inputs(case, torch.float64).items()}
    grad_output = kit.grad_output_for(inputs)
    out = kit.mmcv_pytorch(**leaves)
    actual = {"output": out.detach(),
              **dict(zip(kit.GRAD_NAMES, torch.autograd.grad(out, [leaves[k] for k in kit.DIFFERENTIABLE],
                                                             grad_output)))}
    for result in kit.compare_results(inputs, actual, kit.reference(inputs)):
        assert result.passed, result

"""The knot convention (msda_testkit.knots) on the reference backends: at Deformable DETR's initialisation, where
encoder samples sit on knots (exact ones on power-of-two levels, fp32's near ones elsewhere), every backend's
output and gradients equal the compiled extension's arithmetic, written out in float64 from coordinates rounded
as the extension rounds them. A backend taking the other side of a knot errs by O(1) in the location gradient.

grid_sample is held to it where torch's arithmetic allows: on power-of-two levels, where its coordinate
``((2 * loc - 1 + 1) * W - 1) / 2`` is exact, as the extension's ``loc * W - 0.5`` is. Elsewhere its extra
roundings can move an fp32 coordinate an ulp across the knot and take the other side's derivative."""

import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_testkit import knots

POWERS_OF_TWO = ((8, 8), (4, 2))
OTHER_SIZES = ((6, 10), (3, 5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("levels", [POWERS_OF_TWO, OTHER_SIZES], ids=["powers_of_two", "other_sizes"])
@pytest.mark.parametrize("backend", ["naive", "gather"])
def test_backend_follows_the_extension_at_knots(backend, levels, dtype):
    knots.assert_follows_the_extension(backend, knots.model_init_inputs(levels, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grid_sample_follows_the_extension_at_exact_knots(dtype):
    knots.assert_follows_the_extension("grid_sample", knots.model_init_inputs(POWERS_OF_TWO, dtype=dtype))


def test_the_other_side_of_a_knot_is_caught():
    """The rule is not vacuous: the derivative towards the lower pixel (x0 = ceil(x) - 1) fails it."""
    inputs = knots.model_init_inputs(POWERS_OF_TWO, dtype=torch.float64)
    nudged = dict(inputs, sampling_locations=inputs["sampling_locations"] - 1e-12)
    expected = knots.extension_rule(inputs)
    actual = kit.run(nudged, "gather", kit.grad_output_for(inputs))
    assert not kit.compare("grad_sampling_locations", actual["grad_sampling_locations"],
                           expected["grad_sampling_locations"],
                           kit.tolerance(torch.float64, "gradient")).passed
    kit.assert_close("output", actual["output"], expected["output"], kit.tolerance(torch.float64, "gradient"))


def test_every_backend_here_is_checked():
    assert {"naive", "gather", "grid_sample"} <= set(msda_core.backends())

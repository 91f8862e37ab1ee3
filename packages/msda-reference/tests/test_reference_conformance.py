"""msda-reference's backends on the conformance suite (msda_testkit.conformance): every edge case in every dtype
against float64 naive, the non-finite rules, the knot rule, the fuzz, opcheck, gradcheck, replays, compile and
export, generated from each backend's declarations (grid_sample also on CUDA where there is one: nox -s gpu)."""

import pytest
from msda_testkit import conformance

WAIVE = {
    "grid_sample-*-knots-*-other_sizes": "torch's grid_sample computes the coordinate ((2 * loc - 1 + 1) * W - 1) / 2: "
                                         "off power-of-two levels its extra roundings can move an fp32 coordinate "
                                         "an ulp across a knot (held to the rule on power-of-two levels, where "
                                         "its arithmetic is exact as the extension's)",
}
CHECKS = [check for name in ("naive", "grid_sample", "gather") for check in conformance.plan(name, waive=WAIVE)]

# torch's own deprecation, raised inside Inductor and opcheck on these valid calls: nothing this code can change
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_conformance(check):
    conformance.run_under_pytest(check)

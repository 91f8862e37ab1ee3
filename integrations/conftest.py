"""Collects each integration test's result into one table, printed at the end of the run."""

import dataclasses

import pytest
import torch
from msda_core import compat

# As a user's first line: mmcv._ext (mmcv-lite has none) is msda's stand-in before anything imports mmcv.ops.
compat.install_extension_shim(mmcv=True)

# The models are tiny: with several threads, OpenMP's waiting on this shared 2-core machine made a 0.1 ms op take
# 30 ms (a Deformable DETR step 2.5 s instead of 0.05 s).
torch.set_num_threads(1)

RESULTS = {}  # model name -> equivalence.Result's fields


@pytest.fixture
def record(request):
    """Call with a model's name and its equivalence.Result to put them in the summary table. They travel in the
    test's report, which pytest-xdist's workers send to the process that prints the table."""
    return lambda name, result: request.node.user_properties.append(("msda", (name, dataclasses.asdict(result))))


def pytest_runtest_logreport(report):
    RESULTS.update(value for key, value in report.user_properties if key == "msda" and report.when == "call")


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("msda against each library's PyTorch path (shims: the float64 reference), float64, CPU")
    terminalreporter.write_line(f"{'model':<30} {'mechanism':<18} {'output err':>11} {'grad err':>10} {'calls':>6} "
                                f"{'min knot dist':>14} {'verified':>9}")
    for name, r in RESULTS.items():
        terminalreporter.write_line(f"{name:<30} {'+'.join(r['mechanisms']):<18} {r['output_error']:>11.2e} "
                                    f"{r['gradient_error']:>10.2e} {r['calls']:>6} {r['min_knot_distance']:>14.2e} "
                                    f"{r['verified']:>9}")

"""The deploy tests' results table: one row per runtime, model and graph form, printed at the end of the run."""

import dataclasses

import pytest
import torch
from harness import Row

# The models are tiny: one thread each (two pytest-xdist workers share CI's 2 cores).
torch.set_num_threads(1)

ROWS: list = []


@pytest.fixture
def record(request):
    """Call with a harness.Row to put it in the closing table. Rows travel in the test's report, which
    pytest-xdist's workers send to the process that prints the table."""
    return lambda row: request.node.user_properties.append(("deploy", dataclasses.asdict(row)))


def pytest_runtest_logreport(report):
    ROWS.extend(Row(**value) for key, value in report.user_properties if key == "deploy" and report.when == "call")


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    terminalreporter.section("deploy: each runtime against the patched model's eager output (fp32 CPU)")
    header = f"{'runtime':<12} {'version':<10} {'model':<28} {'form':<32} {'dtype':<22} {'dynamic':<15} " \
             f"{'worst err':>9} {'convert s':>9}"
    terminalreporter.write_line(header)
    for r in ROWS:
        terminalreporter.write_line(f"{r.runtime:<12} {r.version:<10} {r.model:<28} {r.form:<32} {r.dtype:<22} "
                                    f"{r.dynamic:<15} {r.worst:>9.2e} {r.convert_s:>9.1f}")

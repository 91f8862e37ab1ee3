"""The Triton backend on the conformance suite (msda_testkit.conformance): every edge case in every dtype and
accumulation path, and in the deterministic mode, against float64 naive; the non-finite rules, the knot rule, the
fuzz, opcheck, replays, compile and export. On the GPU (nox -s gpu), or on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, nox -s cpu), which runs each kernel in Python: hence the smaller fuzz and the
checks waived there."""

import pytest
from msda_testkit import conformance
from triton_env import DEVICE, needs_kernels

_UNTRACEABLE = ("Triton's interpreter cannot be traced (wrap_triton hands back the kernel itself): runs on the GPU "
                "(nox -s gpu)")
WAIVE = {
    "triton-cpu-opcheck_schema-*": "runs each op several times, minutes under Triton's interpreter: runs on the GPU",
    "triton-cpu-opcheck_aot-*": _UNTRACEABLE,
    "triton-cpu-compile-*": _UNTRACEABLE,
    "triton-cpu-export-*": _UNTRACEABLE,
}
BUDGET = conformance.Budget(fuzz_examples=100 if DEVICE == "cuda" else 40)
CHECKS = conformance.plan("triton", budget=BUDGET, devices=(DEVICE,), waive=WAIVE) if DEVICE else []

pytestmark = needs_kernels


@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_conformance(check):
    conformance.run_under_pytest(check)

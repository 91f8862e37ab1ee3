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
# The interpreter runs each program in Python: there the other variants of a dtype (fp32 locations, the other
# accumulation path, the deterministic mode) run the cases that reach each kernel's distinct code (bounds, head
# dims, strides, many levels, non-finite values, crowded atomics); the GPU runs every case of every variant.
OTHER_VARIANT_CASES = ("tiny", "out_of_bounds", "past_edges", "head_dim_71", "non_contiguous", "many_levels_points",
                       "nonfinite", "crowded")
BUDGET = (conformance.Budget(fuzz_examples=100) if DEVICE == "cuda" else
          conformance.Budget(fuzz_examples=40, other_variant_cases=OTHER_VARIANT_CASES))
CHECKS = conformance.plan("triton", budget=BUDGET, devices=(DEVICE,), waive=WAIVE) if DEVICE else []

pytestmark = needs_kernels


@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_conformance(check):
    conformance.run_under_pytest(check)

"""msda-testkit: tolerance table, input generators, comparisons, cross-backend parity, bit-exact replays,
the kernel manifest check, the deployment helpers, and the entry points of the tools."""

from . import deploy
from .cases import (
    ARGUMENTS,
    DETR_LEVELS,
    DIFFERENTIABLE,
    EDGE_CASES,
    GRADCHECK_HEAD_DIMS,
    SMALL_CASES,
    STANDARD_CASES,
    Case,
    case,
    grad_output_for,
    make_inputs,
    upcast,
    with_head_dim,
)
from .compare import Comparison, assert_close, compare
from .parity import GRAD_NAMES, assert_parity, check_parity, compare_results, grad_value_effect, reference, run
from .replay import assert_replays_bit_exact
from .tolerances import TOLERANCES, Tolerance, tolerance

__version__ = "0.2.0"

__all__ = [
    "ARGUMENTS", "DETR_LEVELS", "DIFFERENTIABLE", "EDGE_CASES", "GRADCHECK_HEAD_DIMS", "GRAD_NAMES", "SMALL_CASES",
    "STANDARD_CASES", "TOLERANCES", "Case", "Comparison", "Tolerance", "assert_close", "assert_parity",
    "assert_replays_bit_exact", "case", "check_parity", "compare", "compare_results", "deploy", "grad_output_for",
    "grad_value_effect", "make_inputs", "reference", "run", "tolerance", "upcast", "with_head_dim",
]

"""msda-testkit: tolerance table, input generators, comparisons, cross-backend parity, bit-exact replays,
the kernel manifest check, and the report and bench entry points."""

from .cases import (
    ARGUMENTS, DETR_LEVELS, DIFFERENTIABLE, EDGE_CASES, GRADCHECK_HEAD_DIMS, SMALL_CASES, STANDARD_CASES, Case, case,
    grad_output_for, make_inputs, upcast, with_head_dim,
)
from . import deploy
from .compare import Comparison, assert_close, compare
from .replay import assert_replays_bit_exact
from .parity import GRAD_NAMES, assert_parity, check_parity, compare_results, grad_value_effect, reference, run
from .tolerances import TOLERANCES, Tolerance, tolerance

__version__ = "0.1.0"

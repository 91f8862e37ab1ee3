"""msda-testkit: what the tests import. The tolerance table, input generators, comparisons, cross-backend parity,
bit-exact replays, mmcv's formulation (a published-formula reference), the kernel manifest check, the deployment
helpers, and three checks run as commands: the conformance suite every backend passes
(``python -m msda_testkit.conformance``), ``python -m msda_testkit.verify`` and ``msda_testkit.distributed``. The
timing tools are msda-benchmarks'."""

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
    infinite_pixel_inputs,
    make_inputs,
    upcast,
    with_head_dim,
)
from .compare import Comparison, assert_close, compare
from .mmcv_formulation import mmcv_pytorch
from .parity import GRAD_NAMES, assert_parity, check_parity, compare_results, grad_value_effect, reference, run
from .replay import assert_replays_bit_exact
from .tolerances import TOLERANCES, Tolerance, tolerance

__version__ = "0.2.0"

__all__ = [
    "ARGUMENTS", "DETR_LEVELS", "DIFFERENTIABLE", "EDGE_CASES", "GRADCHECK_HEAD_DIMS", "GRAD_NAMES", "SMALL_CASES",
    "STANDARD_CASES", "TOLERANCES", "Case", "Comparison", "Tolerance", "assert_close", "assert_parity",
    "assert_replays_bit_exact", "case", "check_parity", "compare", "compare_results", "deploy", "grad_output_for",
    "grad_value_effect", "infinite_pixel_inputs", "make_inputs", "mmcv_pytorch", "reference", "run", "tolerance",
    "upcast", "with_head_dim",
]

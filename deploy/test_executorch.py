"""ExecuTorch: a .pte built from torch.export and msda's decomposition table (core aten ops, no msda op), run with
ExecuTorch's Python runtime (its portable CPU kernels), with batch and queries dynamic."""

import msda_testkit as kit
import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.verification.verifier import SpecViolationError
from executorch.runtime import Runtime
from harness import (
    DECODER,
    Attention,
    Row,
    Timer,
    check,
    decomposed,
    eager,
    nudge_program,
    op_inputs,
    small_dynamic_shapes,
    version,
)

FP32 = kit.tolerance(torch.float32, "forward")
VERSION = version("executorch")


def to_pte(program) -> bytes:
    return to_edge_transform_and_lower(program).to_executorch().buffer


def run(pte: bytes, args) -> list:
    return Runtime.get().load_program(pte).load_method("forward").execute(list(args))


def test_op(record):
    """The decoder-like shape: with its memory planned for up to 4 images of 64 queries, an encoder-like shape
    (a query per pixel) would add nothing here but time."""
    shape = DECODER
    row = Row("ExecuTorch", VERSION, f"op {shape.name}", "aten (decomposition_table)", "fp32", "batch, queries")
    model = Attention(shape.levels)
    with Timer(row):
        pte = to_pte(decomposed(model, op_inputs(shape, 2, 40), small_dynamic_shapes()))
    for batch, queries in ((1, 7), (3, 45)):
        args = op_inputs(shape, batch, queries, seed=batch)
        check(row, run(pte, args), eager(model, args), FP32, f"B{batch} Q{queries}")
    record(row)


def test_a_changed_constant_fails_the_check():
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2, 40)
    pte = to_pte(nudge_program(decomposed(model, args), 0.5, 0.501))
    with pytest.raises(AssertionError, match="elements outside"):
        check(Row("ExecuTorch", VERSION, "op", "aten", "fp32", ""), run(pte, args), eager(model, args), FP32)


def test_without_msdas_table_the_program_is_not_core_aten():
    """torch.export's own decompositions run the op's CPU backend (gather), whose bit tricks are not core aten:
    ExecuTorch refuses it, naming the op. The README's call passes msda_core.export.decomposition_table()."""
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2, 40)
    program = torch.export.export(model, args).run_decompositions()
    with pytest.raises(SpecViolationError, match="is not in Core ATen opset"):
        to_pte(program)

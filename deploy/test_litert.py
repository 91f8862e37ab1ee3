"""LiteRT: litert-torch converts the program that msda's decomposition table leaves (core aten ops, no msda op, no
GridSample), and ai-edge-litert's interpreter runs the .tflite. Static shapes: litert-torch 0.10 fails to lower
this program with batch and queries dynamic (asserted below)."""

import litert_torch
import msda_core
import msda_testkit as kit
import numpy as np
import pytest
import torch
from ai_edge_litert.interpreter import Interpreter
from harness import (
    DECODER,
    ENCODER,
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
VERSION = f"{version('litert-torch')} / {version('ai-edge-litert')}"


def to_tflite(program, args) -> bytes:
    return litert_torch.convert(program.module(), args).model_content()


def run(tflite: bytes, args) -> list:
    runner = Interpreter(model_content=tflite).get_signature_runner()
    names = sorted(runner.get_input_details(), key=lambda n: runner.get_input_details()[n]["index"])
    outputs = runner(**{name: a.numpy() for name, a in zip(names, args)})
    return [np.asarray(outputs[name]) for name in sorted(outputs)]


@pytest.mark.parametrize("shape", [DECODER, ENCODER], ids=lambda s: s.name)
def test_op(shape, record):
    row = Row("LiteRT", VERSION, f"op {shape.name}", "aten (decomposition_table)", "fp32", "none (static)")
    model, args = Attention(shape.levels), op_inputs(shape, 2, seed=1)
    with Timer(row):
        tflite = to_tflite(decomposed(model, args), args)
    check(row, run(tflite, args), eager(model, args), FP32)
    record(row)


def test_a_changed_constant_fails_the_check():
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2)
    tflite = to_tflite(nudge_program(decomposed(model, args), 0.5, 0.501), args)
    with pytest.raises(AssertionError, match="elements outside"):
        check(Row("LiteRT", VERSION, "op", "aten", "fp32", ""), run(tflite, args), eager(model, args), FP32)


def test_dynamic_batch_and_queries_do_not_lower_yet():
    """litert-torch 0.10 compares a symbolic size with an int while lowering: the known limit of the LiteRT row."""
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2, 40)
    program = decomposed(model, args, small_dynamic_shapes())
    with pytest.raises(TypeError, match="not supported between instances of 'int' and 'Node'"):
        litert_torch.convert(program.module(), args, dynamic_shapes=small_dynamic_shapes())


def test_without_msdas_table_the_conversion_fails():
    """litert-torch's own decompositions run the op's CPU backend, whose bit tricks have no LiteRT lowering."""
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2)
    with pytest.raises(RuntimeError, match="Lowering not found: aten.bitwise_right_shift"):
        litert_torch.convert(model, args)


def test_under_portable_the_model_itself_converts(record):
    """The one call that makes ``litert_torch.convert(model)`` (ultralytics' format="litert") work: inside
    msda_core.export.portable() torch.export records the gather arithmetic, with no table passed."""
    row = Row("LiteRT", VERSION, "op decoder", "convert(model) in portable()", "fp32", "none (static)")
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2, seed=5)
    with Timer(row), msda_core.export.portable():
        tflite = litert_torch.convert(model, args).model_content()
    check(row, run(tflite, args), eager(model, args), FP32)
    record(row)

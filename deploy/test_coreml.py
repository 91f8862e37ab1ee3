"""CoreML: coremltools converts the program that msda's decomposition table leaves to an ML program (fp32 compute:
CoreML's default fp16 would round the sampling coordinates to 1/1024 of a map, about a pixel on a 1000-pixel
level); every operation of the op's program has rank <= 5 (CoreML's limit). Prediction needs macOS: on Linux
coremltools refuses it (asserted), so the numbers of this row come from the program's ops, not from a run."""

import coremltools as ct
import msda_core
import pytest
import torch
from harness import DECODER, ENCODER, Attention, Row, Timer, decomposed, detector, images, op_inputs, version

VERSION = version("coremltools")


def convert(program):
    return ct.convert(program, convert_to="mlprogram", compute_precision=ct.precision.FLOAT32,
                      skip_model_load=True)


def operations(mlmodel) -> list:
    """(op type, output rank, output dtype) of every operation of the ML program."""
    return [(op.op_type, o.rank, o.dtype.__name__) for f in mlmodel._mil_program.functions.values()
            for op in f.operations for o in op.outputs]


def test_op_converts_with_rank_5_at_most(record):
    """The encoder-like shape: the ranks and ops are the decoder's, the sizes larger."""
    shape = ENCODER
    row = Row("CoreML", VERSION, f"op {shape.name}", "aten (decomposition_table)", "fp32", "none (static)")
    model, args = Attention(shape.levels), op_inputs(shape, 2)
    with Timer(row):
        mlmodel = convert(decomposed(model, args))
    ops = operations(mlmodel)
    assert {"gather", "floor", "reduce_sum"} <= {op for op, _, _ in ops}
    assert max(rank for _, rank, _ in ops) <= 5, [op for op in ops if op[1] > 5]
    assert {dtype for op, _, dtype in ops if op in ("floor", "reduce_sum")} == {"fp32"}
    row.worst = float("nan")  # not run: see the module docstring
    record(row)
    with pytest.raises(Exception, match="macOS"):
        mlmodel.predict({name: a.numpy() for name, a in zip(("value", "sampling_locations", "attention_weights"),
                                                              args)})


def test_transformers_deformable_detr_does_not_convert_yet():
    """coremltools 9.0 has no conversion for aten.prod.dim_int, which transformers' Deformable DETR calls itself
    (``spatial_shapes.prod(1)`` for its level starts), before and after msda_core.patch: the known limit of the
    CoreML row for that model. msda's own program has no prod (test above)."""
    with pytest.raises(NotImplementedError, match="prod.dim_int"):
        convert(decomposed(detector("deformable_detr"), (images(1),)))


def test_traced_op_converts_under_portable(record):
    """coremltools' TorchScript route (``ct.convert(torch.jit.trace(model, args))``, what ultralytics'
    format="coreml" calls): inside msda_core.export.portable() the trace has no msda op, and the ML program has
    the gather arithmetic in fp32 at rank <= 5. Without it the conversion meets msda::deform_attn (asserted)."""
    row = Row("CoreML", VERSION, "op decoder", "jit.trace in portable()", "fp32", "none (traced)")
    model, args = Attention(DECODER.levels), op_inputs(DECODER, 2)
    inputs = [ct.TensorType(shape=a.shape) for a in args]
    with pytest.raises(Exception, match="deform_attn"):
        ct.convert(torch.jit.trace(model, args), inputs=inputs, convert_to="mlprogram", skip_model_load=True)
    with Timer(row):
        with msda_core.export.portable():
            traced = torch.jit.trace(model, args)
        mlmodel = ct.convert(traced, inputs=inputs, convert_to="mlprogram", compute_precision=ct.precision.FLOAT32,
                             skip_model_load=True)
    ops = operations(mlmodel)
    assert {"gather", "floor", "reduce_sum"} <= {op for op, _, _ in ops}
    assert max(rank for _, rank, _ in ops) <= 5, [op for op in ops if op[1] > 5]
    assert {dtype for op, _, dtype in ops if op in ("floor", "reduce_sum")} == {"fp32"}
    row.worst = float("nan")  # not run: prediction needs macOS
    record(row)

"""onnxruntime (CPU) runs both standard graph forms at opsets 16 to 20, with batch and queries dynamic (run at sizes
the export did not see), in fp32 and as an fp16 graph whose attention computes in fp32; and the tiny transformers
detectors, patched, exported by torch's two exporters called as users call them (no msda argument)."""

import msda_testkit as kit
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from harness import (
    DECODER,
    ENCODER,
    OPSETS,
    STANDARD_FORMS,
    Attention,
    Row,
    check,
    detector,
    detector_graph,
    eager,
    images,
    op_graph,
    op_inputs,
    op_types,
    opset,
)

FP32 = kit.tolerance(torch.float32, "forward")
FP16 = kit.tolerance(torch.float16, "forward")
# sizes the exports did not see (they trace batch 2 and the shape's own query count)
OP_SIZES = ((1, 7), (3, 45))


def run(model_bytes: bytes, args) -> list:
    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})


def row(model, form, dtype="fp32", dynamic="batch, queries") -> Row:
    return Row("onnxruntime", onnxruntime.__version__, model, form, dtype, dynamic)


@pytest.mark.parametrize("version", OPSETS)
@pytest.mark.parametrize("form", STANDARD_FORMS)
def test_op_decoder_at_each_opset(form, version, record):
    result = row(f"op decoder, opset {version}", form)
    data = op_graph(DECODER, form, version, row=result)
    assert opset(data) == version
    assert ("GridSample" in op_types(data)) == (form == "grid_sample")
    model = Attention(DECODER.levels)
    for batch, queries in OP_SIZES:
        args = op_inputs(DECODER, batch, queries, seed=batch)
        check(result, run(data, args), eager(model, args), FP32, f"B{batch} Q{queries}")
    record(result)


@pytest.mark.parametrize("form", STANDARD_FORMS)
def test_op_encoder(form, record):
    result = row("op encoder", form)
    data = op_graph(ENCODER, form, row=result)
    model = Attention(ENCODER.levels)
    for batch, queries in ((1, ENCODER.queries), (3, ENCODER.queries // 2)):
        args = op_inputs(ENCODER, batch, queries, seed=batch)
        check(result, run(data, args), eager(model, args), FP32, f"B{batch} Q{queries}")
    record(result)


@pytest.mark.parametrize("form", STANDARD_FORMS)
def test_op_fp16_graph_computes_the_attention_in_fp32(form, record):
    """fp16 in and out; inside, every coordinate, sample and sum in fp32. Held to the fp16 forward entry against
    the fp32 op on the same inputs upcast: one rounding of the output to fp16."""
    result = row("op decoder", form, dtype="fp16 (attention fp32)")
    data = op_graph(DECODER, form, dtype=torch.float16, row=result)
    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(data))
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.input)}
    arithmetic = [n for n in model.graph.node if n.op_type in ("Floor", "GridSample", "ReduceSum")]
    assert arithmetic and all(types[n.input[0]] == onnx.TensorProto.FLOAT for n in arithmetic), \
        [(n.op_type, types.get(n.input[0])) for n in arithmetic]
    for batch, queries in OP_SIZES:
        args = op_inputs(DECODER, batch, queries, dtype=torch.float16, seed=batch)
        (got,) = run(data, args)
        assert got.dtype == np.float16
        check(result, [got], eager(Attention(DECODER.levels), [a.float() for a in args]), FP16,
              f"B{batch} Q{queries}")
    record(result)


def nudged(model_bytes: bytes, old: float, new: float) -> bytes:
    """The model with every float scalar constant equal to ``old`` set to ``new``: a number an export could change
    without anything else showing."""
    model = onnx.load_from_string(model_bytes)
    tensors = [*model.graph.initializer,
               *(a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value")]
    changed = 0
    for tensor in tensors:
        array = onnx.numpy_helper.to_array(tensor)
        if array.size == 1 and array.dtype.kind == "f" and float(array) == old:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.full_like(array, new), tensor.name))
            changed += 1
    assert changed, f"no constant {old} in the graph"
    return model.SerializeToString()


@pytest.mark.parametrize("form, old, new", [("gather", 0.5, 0.501), ("grid_sample", 2.0, 2.002)])
def test_a_changed_constant_fails_the_check(form, old, new):
    """The check has teeth: the half-pixel offset (gather) or the grid's scale (grid_sample) moved by 0.1% moves
    samples by about 1/1000 of a pixel, and the fp32 entry rejects it."""
    data = nudged(op_graph(DECODER, form), old, new)
    args = op_inputs(DECODER, 3, 45, seed=3)
    with pytest.raises(AssertionError, match="elements outside"):
        check(row("op decoder", form), run(data, args), eager(Attention(DECODER.levels), args), FP32)


@pytest.mark.parametrize("name, dynamo, batches", [
    ("deformable_detr", True, (1, 3)), ("deformable_detr", False, (1, 3)), ("rt_detr_v2", False, (1,)),
])
def test_patched_detector(name, dynamo, batches, record):
    """Exported at batch 2 with the batch dynamic, run at other batches. With no msda argument torch's exporters
    take msda's default, the gather form: no GridSample. (Both forms at every opset: the op alone, above; a
    detector's dynamo export takes 15-60 s here, so CI exports each once.) RT-DETRv2 goes through the TorchScript
    exporter: torch.export specializes its batch in transformers' own code, patched or not. Its decoder picks its
    queries by top-k over random-weight scores with ties, which onnxruntime breaks otherwise than torch: its
    decoder rows are compared as a set (sorted), at batch 1, where the same queries are picked."""
    how = "torch.onnx.export, dynamo" if dynamo else "torch.onnx.export(dynamo=False)"
    result = row(name, f"{how} (gather)", dynamic="batch")
    data = detector_graph(name, None, dynamo, result)
    assert "GridSample" not in op_types(data)
    model = detector(name)
    for batch in batches:
        args = (images(batch, seed=batch),)
        got, expected = run(data, args), eager(model, args)
        if name == "rt_detr_v2":
            got, expected = [by_first_feature(torch.as_tensor(got[0])), *got[1:]], [by_first_feature(expected[0]),
                                                                                    *expected[1:]]
        check(result, got, expected, FP32, f"B{batch}")
    record(result)


def by_first_feature(hidden):
    """(B, Q, C) with each image's Q rows sorted by their first feature."""
    return torch.stack([rows[rows[:, 0].argsort()] for rows in hidden])

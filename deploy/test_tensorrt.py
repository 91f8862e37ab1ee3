"""TensorRT, checked statically (no TensorRT runs on these machines): onnxsim simplifies each graph (folding what
TensorRT would fold at build time), onnxruntime checks the simplified graph's numbers, and then
- the gather form uses only operators that onnx-tensorrt's support matrix lists (tensorrt_onnx_ops), at an opset it
  covers, with element types it lists and the inputs it needs constant constant: no GridSample, which TensorRT 10.14
  and 11.1 miscompile for this op (NVIDIA/TensorRT#4813);
- the plugin form's node matches MultiscaleDeformableAttnPlugin_TRT's published signature (TensorRT's
  plugin/multiscaleDeformableAttnPlugin: README and supportsFormatCombination): five inputs value (N, S, M, D),
  spatial_shapes (L, 2) int32, level_start_index (L,) int32, sampling_locations (N, Lq, M, L, P, 2),
  attention_weights (N, Lq, M, L, P), the three float ones one type, fp32 or fp16; no attributes needed (its
  creator has no fields; onnx-tensorrt reads plugin_version); its output (N, Lq, M, D), which our graph reshapes to
  (N, Lq, M*D)."""

import msda_testkit as kit
import numpy as np
import onnx
import onnxruntime
import onnxsim
import pytest
import torch
from harness import (
    DECODER,
    OPSETS,
    Attention,
    Row,
    Timer,
    check,
    detector_graph,
    eager,
    onnx_export,
    op_graph,
    op_inputs,
    version,
)
from tensorrt_onnx_ops import CONSTANT_INPUTS, SUPPORTED
from tensorrt_onnx_ops import OPSETS as TENSORRT_OPSETS

FP32 = kit.tolerance(torch.float32, "forward")
TYPES = {onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.FLOAT16: "FP16", onnx.TensorProto.BFLOAT16: "BF16",
         onnx.TensorProto.INT32: "INT32", onnx.TensorProto.INT64: "INT64", onnx.TensorProto.BOOL: "BOOL"}


def simplified(data: bytes) -> onnx.ModelProto:
    model, _ = onnxsim.simplify(onnx.load_from_string(data), check_n=0)
    return model


def inferred(data: bytes) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(onnx.load_from_string(data))


# operators whose first input is not the data the matrix's types are about (a shape, or any tensor read for its shape)
SHAPE_INPUT = ("Shape", "Cast", "ConstantOfShape", "Size")


def unsupported(model: onnx.ModelProto) -> list:
    """Each node the matrix rejects: its operator, an input type it does not list, or an input it needs constant
    that is computed."""
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.input)}
    types |= {i.name: i.data_type for i in model.graph.initializer}
    problems = []
    for node in model.graph.node:
        if node.op_type not in SUPPORTED:
            problems.append(f"{node.op_type}: not supported")
            continue
        kind = TYPES.get(types.get(node.input[0])) if node.input else None  # the data's type, where inferred
        if kind and kind not in SUPPORTED[node.op_type] and node.op_type not in SHAPE_INPUT:
            problems.append(f"{node.op_type}: input type {kind}")
        index = CONSTANT_INPUTS.get(node.op_type)
        if index is not None and len(node.input) > index and node.input[index] not in constants:
            problems.append(f"{node.op_type}: input {index} computed")
    return problems


def ort(model: onnx.ModelProto, args) -> list:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})


@pytest.mark.parametrize("version_", OPSETS)
def test_gather_form_uses_only_what_onnx_tensorrt_supports(version_, record):
    row = Row("TensorRT", "static", f"op decoder, opset {version_}", "gather", "fp32", "batch, queries")
    data = op_graph(DECODER, "gather", version_)
    model = inferred(data)
    assert model.opset_import[0].version in TENSORRT_OPSETS
    assert unsupported(model) == []
    with Timer(row):
        model = simplified(data)
    args = op_inputs(DECODER, 3, 45, seed=3)
    check(row, ort(model, args), eager(Attention(DECODER.levels), args), FP32)
    row.version = f"onnxsim {version('onnxsim')}"
    record(row)


@pytest.mark.parametrize("version_", OPSETS)
def test_torchscript_exporters_gather_form_uses_only_what_onnx_tensorrt_supports(version_):
    """The same form from the TorchScript exporter's symbolic (``dynamo=False``), node for node the table's."""
    args = op_inputs(DECODER, 2)
    axes = ({0: "batch"}, {0: "batch", 1: "queries"}, {0: "batch", 1: "queries"})
    data = onnx_export(Attention(DECODER.levels), args, None, version_, axes, dynamo=False)
    model = inferred(data)
    assert "Clip" not in {n.op_type for n in model.graph.node}
    assert unsupported(model) == []
    args = op_inputs(DECODER, 3, 45, seed=3)
    check(Row("TensorRT", "static", "op decoder", "gather", "fp32", "batch, queries"), ort(model, args),
          eager(Attention(DECODER.levels), args), FP32)


class AttentionOfInputShapes(torch.nn.Module):
    """The op with its level table a graph input and no level starts: the starts are computed in the graph."""

    def forward(self, value, spatial_shapes, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, spatial_shapes, None, sampling_locations, attention_weights)


@pytest.mark.parametrize("version_", (OPSETS[0], OPSETS[-1]))
def test_default_exporters_gather_form_computes_level_starts_as_tensorrt_supports(version_):
    """``torch.onnx.export(model, args)`` with no msda argument records msda_core.export's gather arithmetic; its
    level starts, computed from a level table that is an input, must not become an int64 CumSum."""
    value, locations, weights = op_inputs(DECODER, 2)
    shapes = torch.tensor(DECODER.levels)
    data = onnx_export(AttentionOfInputShapes(), (value, shapes, locations, weights), None, version_)
    model = inferred(data)
    assert unsupported(model) == []
    check(Row("TensorRT", "static", "op decoder", "gather", "fp32", "none"), ort(model, (value, shapes, locations,
          weights)), eager(Attention(DECODER.levels), (value, locations, weights)), FP32)


def test_the_checker_rejects_an_unlisted_operator_and_a_computed_axes():
    """The check can fail: BitShift is not in the matrix, and Pad needs its axes constant."""
    pad = onnx.helper.make_node("Pad", ["x", "pads", "", "axes"], ["y"])
    model = onnx.helper.make_model(onnx.helper.make_graph([pad, onnx.helper.make_node("BitShift", ["y", "y"], ["z"])],
                                                          "g", [], []))
    assert unsupported(model) == ["Pad: input 3 computed", "BitShift: not supported"]


def test_patched_deformable_detr_gather_graph(record):
    row = Row("TensorRT", f"onnxsim {version('onnxsim')}", "deformable_detr", "torch.onnx.export (gather)", "fp32",
              "batch")
    data = detector_graph("deformable_detr", None, result=row)
    model = inferred(data)
    assert "GridSample" not in {n.op_type for n in model.graph.node}
    assert unsupported(model) == []
    with Timer(row):
        simplified(data)
    row.worst = float("nan")  # its numbers: onnxruntime's and OpenVINO's rows of the same graph
    record(row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_plugin_form_matches_the_published_signature(dtype):
    data = op_graph(DECODER, "tensorrt", dtype=dtype)
    simplified(data)
    model = inferred(data)
    (node,) = [n for n in model.graph.node if n.op_type == "MultiscaleDeformableAttnPlugin_TRT"]
    values = {v.name: v.type.tensor_type for v in (*model.graph.value_info, *model.graph.input)}
    inputs = [values[name] for name in node.input]
    assert [len(t.shape.dim) for t in inputs] == [4, 2, 1, 6, 5]
    float_type = onnx.TensorProto.FLOAT16 if dtype == torch.float16 else onnx.TensorProto.FLOAT
    assert [t.elem_type for t in inputs] == [float_type, onnx.TensorProto.INT32, onnx.TensorProto.INT32,
                                             float_type, float_type]
    assert {a.name for a in node.attribute} <= {"plugin_version"}
    assert [a.s for a in node.attribute] in ([], [b"1"])
    # M, L and P agree where the plugin asserts they do (configurePlugin), and N, Lq of the locations and weights
    dims = [[d.dim_value or d.dim_param for d in t.shape.dim] for t in inputs]
    value, shapes, starts, locations, weights = dims
    assert value[2] == locations[2] == weights[2] and shapes[0] == starts[0] == locations[3] == weights[3]
    assert locations[4] == weights[4] and locations[:2] == weights[:2] and value[0] == locations[0]
    # the output, (N, Lq, M, D), is reshaped to (N, Lq, M*D): the shape (locations' N and Lq, -1)
    (reshape,) = [n for n in model.graph.node if node.output[0] in n.input]
    assert reshape.op_type == "Reshape"
    shape = ort_shape_of(model, reshape.input[1], op_inputs(DECODER, 3, 45, dtype=dtype))
    assert list(shape) == [3, 45, -1]


def ort_shape_of(model: onnx.ModelProto, name: str, args) -> np.ndarray:
    """The value of one tensor of the graph on args, computed by onnxruntime with the plugin node cut away."""
    keep = []
    needed = {name}
    for node in reversed(model.graph.node):
        if needed & set(node.output):
            keep.append(node)
            needed |= set(node.input)
    graph = onnx.helper.make_graph(list(reversed(keep)), "shape", list(model.graph.input),
                                   [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None)],
                                   list(model.graph.initializer))
    cut = onnx.helper.make_model(graph, opset_imports=[model.opset_import[0]], ir_version=model.ir_version)
    (value,) = ort(cut, args)
    return value

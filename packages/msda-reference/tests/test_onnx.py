"""ONNX export of the op (msda_core.onnx), with both of torch's exporters, run in onnxruntime on CPU.

Every exported graph is judged against the float64 reference on the same inputs (upcast), at the tolerance
table's entry for its output dtype, at the batch and query count it was exported with and at two others it never
saw (batch and queries are dynamic), plus, for the gather form, non-finite locations."""

import dataclasses
import io
import subprocess
import sys

import msda_core
import msda_core.onnx
import msda_testkit as kit
import pytest
import torch

# torch's own warnings on these valid calls (its exporters' renaming of dynamic axes, their deprecations):
# nothing this code can change
pytestmark = [
    pytest.mark.filterwarnings("ignore:# The axis name:UserWarning"),
    pytest.mark.filterwarnings("ignore:# ONNX model has different number of inputs:UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

F32, F16 = torch.float32, torch.float16
LEVELS = ((8, 6), (4, 3))
# small versions of the two calls a DETR makes: every pixel a query (encoder), a few queries reaching past the maps
ENCODER = kit.Case("encoder_like", batch=1, queries=60, heads=2, head_dim=4, levels=LEVELS, loc_range=(-0.1, 1.1))
DECODER = kit.Case("decoder_like", batch=2, queries=7, heads=2, head_dim=4, levels=LEVELS, loc_range=(-0.5, 1.5))
NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


class Attention(torch.nn.Module):
    """The op alone, as a model calls it."""

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights)


def _inputs(case, dtype, seed=0) -> dict:
    """The op's inputs; the decoder-like calls pass no level_start_index (the graph derives it)."""
    inputs = kit.make_inputs(case, dtype, seed=seed)
    return inputs if case.name == ENCODER.name else inputs | {"level_start_index": None}


def _unseen(case, dtype) -> list:
    """Inputs at two batch sizes and two query counts the export did not see."""
    return [_inputs(dataclasses.replace(case, batch=case.batch + 1, queries=case.queries + 5), dtype, seed=1),
            _inputs(dataclasses.replace(case, batch=case.batch + 2, queries=case.queries + 11), dtype, seed=2)]


def _export(exporter, inputs, form, opset) -> bytes:
    """The ONNX model of Attention, batch and queries dynamic."""
    args = tuple(inputs[name] for name in NAMES)
    if exporter == "dynamo":
        program = torch.onnx.export(Attention().eval(), args, dynamo=True, opset_version=opset, verbose=False,
                                    custom_translation_table=msda_core.onnx.translation_table(form),
                                    dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
        return program.model_proto.SerializeToString()
    names = [name for name in NAMES if inputs[name] is not None]
    axes = {name: {0: "batch", 1: "queries"} for name in ("sampling_locations", "attention_weights")}
    f = io.BytesIO()
    with msda_core.onnx.export_form(form):
        torch.onnx.export(Attention().eval(), args, f, dynamo=False, opset_version=opset, input_names=names,
                          dynamic_axes={"value": {0: "batch"}, **axes})
    return f.getvalue()


def _run(model: bytes, inputs: dict) -> torch.Tensor:
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    (out,) = session.run(None, dict(zip(names, [inputs[n].numpy() for n in NAMES if inputs[n] is not None])))
    return torch.from_numpy(out)


def _assert_like_eager(model: bytes, calls: list):
    """The model's output for each call within the tolerance of its dtype of the float64 reference."""
    for inputs in calls:
        got = _run(model, inputs)
        assert got.dtype == inputs["value"].dtype
        expected = kit.reference(inputs, backward=False)["output"]
        kit.assert_close("onnxruntime output", got, expected, kit.tolerance(got.dtype, "forward"))


def _op_types(model: bytes) -> set:
    import onnx

    return {node.op_type for node in onnx.load_from_string(model).graph.node}


EXPORTS = [  # (exporter, form, opset, case, dtype): every form, exporter, end of the opset range and dtype once
    *[("torchscript", form, opset, case, F32) for form in ("gather", "grid_sample") for opset in (16, 20)
      for case in (ENCODER, DECODER)],
    ("torchscript", "gather", 17, DECODER, F16), ("torchscript", "grid_sample", 17, ENCODER, F16),
    ("dynamo", "gather", 16, ENCODER, F16), ("dynamo", "grid_sample", 20, DECODER, F32),
]


@pytest.mark.parametrize("exporter, form, opset, case, dtype", EXPORTS,
                         ids=[f"{e}-{f}-opset{o}-{c.name}-{str(d)[6:]}" for e, f, o, c, d in EXPORTS])
def test_standard_forms_run_in_onnxruntime_like_eager(exporter, form, opset, case, dtype):
    """Both standard forms, at the opset asked for, match eager; the gather form has no GridSample and no tensor
    above rank 5 (and keeps non-finite locations' NaN and zeros); half inputs are computed in float32: every half
    input goes only into a Cast to float32 or a Shape."""
    import onnx

    inputs = _inputs(case, dtype)
    calls = [inputs, *_unseen(case, dtype)]
    if form == "gather":
        calls.append(_inputs(dataclasses.replace(case, layout="nonfinite"), dtype, seed=3))
    model = _export(exporter, inputs, form, opset)
    assert {o.version for o in onnx.load_from_string(model).opset_import if o.domain == ""} == {opset}
    assert ("GridSample" in _op_types(model)) == (form == "grid_sample")
    inferred = onnx.shape_inference.infer_shapes(onnx.load_from_string(model), strict_mode=True).graph
    tensors = [*inferred.input, *inferred.value_info, *inferred.output]
    if form == "gather":  # CoreML's limit: no tensor inside above rank 5 (the locations come in at rank 6)
        ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in tensors if v not in inferred.input}
        assert len(ranks) > 20 and max(ranks.values()) <= 5, ranks
    if dtype == F16:  # half tensors are only cast, reshaped or measured: the arithmetic runs in float32
        halves = {v.name for v in tensors if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
        assert len(halves) >= 4, halves  # the three inputs and the output
        for node in inferred.node:
            assert not halves & set(node.input) or node.op_type in ("Cast", "Shape", "Reshape"), node
    _assert_like_eager(model, calls)


def test_plain_torch_onnx_export_emits_the_gather_form():
    """torch.onnx.export(model, args) with no table (the dynamo exporter, torch's default): the op is recorded as
    msda_core.export's aten decomposition, so the graph is the gather form, dynamic as asked, and matches eager."""
    inputs = _inputs(DECODER, F32)
    args = tuple(inputs[name] for name in NAMES)
    program = torch.onnx.export(Attention().eval(), args, verbose=False,
                                dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
    model = program.model_proto.SerializeToString()
    assert "GridSample" not in _op_types(model) and {"Gather", "Floor", "Where", "ReduceSum"} <= _op_types(model)
    _assert_like_eager(model, [inputs, *_unseen(DECODER, F32)])


def test_a_number_changed_by_the_export_fails_the_comparison():
    """The comparison every export test makes catches a graph that computes something else: the gather graph with
    its -0.5 (align_corners=False) moved by 1/64 pixel fails it."""
    import onnx
    from onnx import numpy_helper

    inputs = _inputs(DECODER, F32)
    model = onnx.load_from_string(_export("torchscript", inputs, "gather", 17))
    halves = [node for node in model.graph.node if node.op_type == "Constant"
              and numpy_helper.to_array(node.attribute[0].t).tolist() == 0.5]
    assert len(halves) == 1
    halves[0].attribute[0].t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(halves[0].attribute[0].t) + 1 / 64))
    with pytest.raises(AssertionError, match="onnxruntime output"):
        _assert_like_eager(model.SerializeToString(), [inputs])


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_tensorrt_plugin_node(exporter):
    """form="tensorrt": one MultiscaleDeformableAttnPlugin_TRT node with int32 level tables, value, locations
    and weights of one float dtype, 5-D weights, and its (B, Q, M, D) output reshaped to (B, Q, M*D)."""
    import onnx

    model = onnx.load_from_string(_export(exporter, _inputs(DECODER, F32), "tensorrt", 18))
    nodes = [n for n in model.graph.node if n.op_type == "MultiscaleDeformableAttnPlugin_TRT"]
    assert len(nodes) == 1 and nodes[0].domain == msda_core.onnx.TRT_DOMAIN
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type for v in [*model.graph.input, *model.graph.value_info]}
    value, shapes, starts, locations, weights = (types.get(name) for name in nodes[0].input)
    assert shapes.elem_type == starts.elem_type == onnx.TensorProto.INT32
    assert value.elem_type == locations.elem_type == weights.elem_type == onnx.TensorProto.FLOAT
    assert [len(t.shape.dim) for t in (value, locations, weights)] == [4, 6, 5]
    (reshape,) = [n for n in model.graph.node if nodes[0].output[0] in n.input]
    assert reshape.op_type == "Reshape"


def test_tensorrt_plugin_refuses_bf16():
    inputs = {k: v.to(torch.bfloat16) if v is not None and v.is_floating_point() else v
              for k, v in _inputs(DECODER, F32).items()}
    with pytest.raises(Exception, match="TensorRT's MultiscaleDeformableAttnPlugin_TRT takes float32 or float16"):
        _export("torchscript", inputs, "tensorrt", 18)


UNCHANGED_EXPORT = """
import io, sys, warnings
import msda_core, msda_testkit as kit, onnx, onnxruntime, torch
from msda_core.nn import MSDeformAttn

warnings.simplefilter("ignore")
torch.manual_seed(0)
levels = torch.tensor([(8, 6), (4, 3)])
attn = MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=2).eval()
def call(batch, queries):
    return (torch.randn(batch, queries, 16), torch.rand(batch, queries, 2, 2), torch.randn(batch, 60, 16), levels)
f = io.BytesIO()
torch.onnx.export(attn, call(2, 7), f, dynamo=False, input_names=["query", "reference_points", "features"],
                  dynamic_axes={"query": {0: "b", 1: "q"}, "reference_points": {0: "b", 1: "q"}, "features": {0: "b"}})
assert "GridSample" not in {node.op_type for node in onnx.load_from_string(f.getvalue()).graph.node}
session = onnxruntime.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
for args in (call(3, 12), call(1, 5)):
    names = [i.name for i in session.get_inputs()]
    (got,) = session.run(None, dict(zip(names, [a.numpy() for a in args])))
    with torch.no_grad():
        kit.assert_close("output", torch.from_numpy(got), attn(*args), kit.tolerance(torch.float32, "forward"))
"""


def test_torchscript_exporter_takes_a_model_unchanged():
    """In a fresh process, torch.onnx.export(model, args, f, dynamo=False) on msda_core.nn.MSDeformAttn with
    nothing passed or called first (the symbolic registers itself at the first traced call): the gather form,
    batch and queries dynamic, like eager."""
    done = subprocess.run([sys.executable, "-c", UNCHANGED_EXPORT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

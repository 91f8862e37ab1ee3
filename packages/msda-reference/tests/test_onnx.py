"""ONNX export of a model using the op (msda_core.onnx), run in onnxruntime on CPU."""

import msda_core
import msda_core.onnx
import msda_testkit as kit
import pytest
import torch

# torch's own warnings on these valid calls (its exporter's renaming of dynamic axes, its internal
# deprecations): nothing this code can change
pytestmark = [
    pytest.mark.filterwarnings("ignore:# The axis name:UserWarning"),
    pytest.mark.filterwarnings("ignore:# ONNX model has different number of inputs:UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]

F32 = torch.float32


def _args(case="out_of_bounds", seed=0, **changes):
    return kit.deploy.layer_inputs(kit.case(case) if isinstance(case, str) else case, F32, seed=seed, **changes)


def _onnx_session(layer, args, plugin=None):
    import onnxruntime

    table = msda_core.onnx.translation_table(plugin)
    program = torch.onnx.export(layer, args, dynamo=True, custom_translation_table=table,
                                dynamic_shapes=kit.deploy.dynamic_batch_and_queries(), verbose=False)
    return program, (onnxruntime.InferenceSession(program.model_proto.SerializeToString(),
                                                  providers=["CPUExecutionProvider"]) if plugin is None else None)


@pytest.mark.parametrize("pass_starts", [True, False])
def test_onnx_standard_ops_run_in_onnxruntime_and_match_eager(pass_starts):
    """One GridSample per level: onnxruntime's CPU result matches eager for out-of-map locations, at the exported
    batch and query count and at others (they are dynamic)."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    layer = kit.deploy.Layer(heads=2, head_dim=2).eval()
    args = _args() if pass_starts else _args(level_start_index=None)
    program, session = _onnx_session(layer, args)
    assert {n.op_type for n in program.model.graph} >= {"GridSample", "ReduceSum"}
    names = [i.name for i in session.get_inputs()]
    other_case = kit.Case("other", batch=3, queries=17, loc_range=(-0.5, 1.5))
    for call in (args, _args(other_case, seed=3, **({} if pass_starts else {"level_start_index": None}))):
        feeds = {name: t.numpy() for name, t in zip(names, [a for a in call if a is not None])}
        (got,) = session.run(None, feeds)
        with torch.no_grad():
            expected = layer(*call)
        kit.assert_close("output", torch.from_numpy(got), expected, kit.tolerance(F32, "forward"))


def test_onnx_tensorrt_plugin_node():
    """plugin="tensorrt": one MultiscaleDeformableAttnPlugin_TRT node with int32 level tables, value, locations
    and weights of one float dtype, 5-D weights, and its (B, Q, M, D) output reshaped to (B, Q, M*D)."""
    pytest.importorskip("onnxscript")
    from onnxscript import ir

    program, _ = _onnx_session(kit.deploy.Layer(heads=2, head_dim=2).eval(), _args(), plugin="tensorrt")
    nodes = [n for n in program.model.graph if n.op_type == "MultiscaleDeformableAttnPlugin_TRT"]
    assert len(nodes) == 1 and nodes[0].domain == msda_core.onnx.TRT_DOMAIN
    value, shapes, starts, locations, weights = nodes[0].inputs
    assert (shapes.dtype, starts.dtype) == (ir.DataType.INT32, ir.DataType.INT32)
    assert value.dtype == locations.dtype == weights.dtype == ir.DataType.FLOAT
    assert len(locations.shape) == 6 and len(weights.shape) == 5 and len(value.shape) == 4
    (reshape,) = [n for n in program.model.graph if nodes[0].outputs[0] in n.inputs]
    assert reshape.op_type == "Reshape"


def test_onnx_tensorrt_plugin_refuses_bf16():
    pytest.importorskip("onnxscript")
    layer = kit.deploy.Layer(heads=2, head_dim=2).to(torch.bfloat16).eval()
    args = tuple(a.to(torch.bfloat16) if a is not None and a.is_floating_point() else a for a in _args())
    with pytest.raises(Exception, match="TensorRT's MultiscaleDeformableAttnPlugin_TRT takes float32 or float16"):
        _onnx_session(layer, args, plugin="tensorrt")


def test_translation_table_names_a_wrong_plugin():
    with pytest.raises(ValueError, match=r"^plugin: expected one of \(None, 'tensorrt'\), got 'trt'"):
        msda_core.onnx.translation_table("trt")

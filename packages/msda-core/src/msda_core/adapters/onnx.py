"""ONNX export of ``msda::deform_attn``: the translation table for ``torch.onnx.export(..., dynamo=True)``.

    table = msda_core.onnx.translation_table()
    program = torch.onnx.export(model, args, dynamo=True, custom_translation_table=table)

The exporter keeps the op as one node because the table names it, then builds it with the function given here:
- standard ops (default): per level one ``GridSample`` (opset 16+, bilinear, zeros padding, align_corners=0, on the
  grid 2 * loc - 1: the op's bilinear sample exactly), times the weights, summed: what onnxruntime runs anywhere.
  The number of levels L is read from the locations' static shape; the level sizes and starts are read from the
  tensors when the model runs, so batch and queries may be dynamic. Half inputs are computed in float32.
- ``plugin="tensorrt"``: one ``MultiscaleDeformableAttnPlugin_TRT`` node (TensorRT's plugin, matched by op_type;
  the custom domain keeps the model valid ONNX) with what it needs around it: int32 level tables, value, locations
  and weights cast to one dtype (fp32, or fp16 for an fp16 value), and its (B, Q, M, D) output reshaped to ours.

onnxscript is imported only when the table is built, so msda-core depends on torch alone.
"""

from __future__ import annotations

import torch

PLUGINS = (None, "tensorrt")
OPSET = 18
TRT_DOMAIN = "trt.plugins"


def translation_table(plugin: str | None = None) -> dict:
    """``{torch.ops.msda.deform_attn.default: function}`` for ``torch.onnx.export``'s ``custom_translation_table``."""
    if plugin not in PLUGINS:
        raise ValueError(f"plugin: expected one of {PLUGINS}, got {plugin!r}")
    import onnxscript

    op = getattr(onnxscript, f"opset{OPSET}")
    build = _tensorrt_node if plugin == "tensorrt" else _standard_ops
    return {torch.ops.msda.deform_attn.default: lambda *args, **options: build(op, *args)}


def _ints(op, *values):
    return op.Constant(value_ints=list(values))


def _cast(op, x, dtype):
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


def _level_starts(op, shapes, level_start_index, dtype):
    """The level starts as given, else the exclusive cumulative sum of H_l * W_l, in ``dtype``."""
    if level_start_index is not None:
        return _cast(op, level_start_index, dtype)
    sizes = op.ReduceProd(shapes, _ints(op, 1), keepdims=0)
    return op.Sub(op.CumSum(sizes, op.Constant(value_int=0)), sizes)


def _standard_ops(op, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    from onnxscript import ir

    f32 = ir.DataType.FLOAT
    out_dtype = value.dtype
    value, locations, weights = (_cast(op, x, f32) for x in (value, sampling_locations, attention_weights))
    shapes = _cast(op, spatial_shapes, ir.DataType.INT64)
    starts = _level_starts(op, shapes, level_start_index, ir.DataType.INT64)
    batch, heads, dim = (op.Shape(value, start=i, end=i + 1) for i in (0, 2, 3))
    queries, points = (op.Shape(locations, start=i, end=i + 1) for i in (1, 4))
    rows = op.Mul(batch, heads)  # grid_sample's batch: one (b, m) per image
    value = op.Transpose(value, perm=[0, 2, 3, 1])  # (B, M, D, S)
    # 2 * loc - 1, clipped to +-3, far outside any map: the same zeros, and no huge coordinate reaches GridSample
    grid = op.Clip(op.Sub(op.Mul(locations, op.Constant(value_float=2.0)), op.Constant(value_float=1.0)),
                   op.Constant(value_float=-3.0), op.Constant(value_float=3.0))
    grid = op.Transpose(grid, perm=[0, 2, 3, 1, 4, 5])  # (B, M, L, Q, P, 2)
    weights = op.Transpose(weights, perm=[0, 2, 3, 1, 4])  # (B, M, L, Q, P)
    total = None
    for level in range(sampling_locations.shape[3]):
        size = op.Gather(shapes, op.Constant(value_int=level), axis=0)  # (2,): H, W
        start = op.Gather(starts, _ints(op, level), axis=0)  # (1,)
        end = op.Add(start, op.ReduceProd(size, keepdims=1))
        value_l = op.Reshape(op.Slice(value, start, end, _ints(op, 3)), op.Concat(rows, dim, size, axis=0))
        grid_l = op.Reshape(op.Gather(grid, op.Constant(value_int=level), axis=2),
                            op.Concat(rows, queries, points, _ints(op, 2), axis=0))
        sampled = op.GridSample(value_l, grid_l, align_corners=0, mode="bilinear", padding_mode="zeros")
        weights_l = op.Reshape(op.Gather(weights, op.Constant(value_int=level), axis=2),
                               op.Concat(rows, _ints(op, 1), queries, points, axis=0))
        term = op.ReduceSum(op.Mul(sampled, weights_l), _ints(op, 3), keepdims=0)  # (B*M, D, Q)
        total = term if total is None else op.Add(total, term)
    out = op.Transpose(op.Reshape(total, op.Concat(batch, heads, dim, queries, axis=0)), perm=[0, 3, 1, 2])
    return _cast(op, op.Reshape(out, op.Concat(batch, queries, _ints(op, -1), axis=0)), out_dtype)


def _plugin_schema():
    """The plugin's inputs and output as an ONNX schema, registered once: the exporter builds nodes from schemas,
    and the checker and shape inference then know the node (its output takes value's type)."""
    import onnx

    name = "MultiscaleDeformableAttnPlugin_TRT"
    if not onnx.defs.has(name, TRT_DOMAIN):
        Parameter = onnx.defs.OpSchema.FormalParameter
        onnx.defs.register_schema(onnx.defs.OpSchema(
            name, TRT_DOMAIN, 1, doc="TensorRT's multi-scale deformable attention plugin (output (B, Q, M, D))",
            inputs=[Parameter("value", "T"), Parameter("spatial_shapes", "tensor(int32)"),
                    Parameter("level_start_index", "tensor(int32)"), Parameter("sampling_locations", "T"),
                    Parameter("attention_weights", "T")],
            outputs=[Parameter("output", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "value, locations and weights alike")],
            attributes=[onnx.defs.OpSchema.Attribute("plugin_version", onnx.defs.OpSchema.AttrType.STRING,
                                                     "the plugin's version", required=False)]))
    return name


def _tensorrt_node(op, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    from onnxscript import ir, values

    if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        raise TypeError(f"value: TensorRT's MultiscaleDeformableAttnPlugin_TRT takes float32 or float16, got "
                        f"{value.dtype}; export with plugin=None (standard ops) instead")
    i32 = ir.DataType.INT32
    shapes = _cast(op, spatial_shapes, i32)
    starts = _level_starts(op, shapes, level_start_index, i32)
    locations, weights = (_cast(op, x, value.dtype) for x in (sampling_locations, attention_weights))
    plugin = getattr(values.Opset(TRT_DOMAIN, 1), _plugin_schema())
    out = plugin(value, shapes, starts, locations, weights, plugin_version="1")
    return op.Reshape(out, op.Concat(op.Shape(locations, start=0, end=2), _ints(op, -1), axis=0))

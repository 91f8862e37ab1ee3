"""ONNX export of ``msda::deform_attn``, with either of torch's exporters, in one of three graph forms.

    torch.onnx.export(model, args)                                        # dynamo exporter (torch's default)
    torch.onnx.export(model, args, f, dynamo=False)                       # TorchScript-based exporter
    torch.onnx.export(model, args, dynamo=True, custom_translation_table=msda_core.onnx.translation_table(form))
    with msda_core.onnx.export_form("grid_sample"):                       # a form for the TorchScript exporter
        torch.onnx.export(model, args, f, dynamo=False)

The forms (``FORMS``):
- ``"gather"`` (the default): the gather backend's arithmetic (msda_core.export's module docstring) in standard
  ops only: Gather, Floor, Mul, Add, Where, ReduceSum and their like, no GridSample and no data-dependent split, so
  runtimes without GridSample (TFLite/LiteRT, NPUs) and TensorRT versions that miscompile it take it. Corners off
  the map read an appended zero row, so no index leaves ``value``. No tensor inside has more than 5 dimensions.
- ``"grid_sample"``: per level one ``GridSample`` (opset 16+, bilinear, zeros padding, align_corners=0, on the grid
  2 * loc - 1: the op's bilinear sample exactly), times the weights, summed: the pattern onnxruntime and OpenVINO
  know.
- ``"tensorrt"``: one ``MultiscaleDeformableAttnPlugin_TRT`` node (TensorRT's plugin, matched by op_type; the custom
  domain keeps the model valid ONNX) with what it needs around it: int32 level tables, value, locations and
  weights cast to one dtype (fp32, or fp16 for an fp16 value), and its (B, Q, M, D) output reshaped to ours.
In the standard forms half inputs are computed in float32 and the output cast back; batch and queries may be
dynamic; L and P are read from the locations' static shape, level sizes and starts from the tensors at run time.

Each form is written once, against a small graph interface (``_Graph``) that both exporters provide: onnxscript's
ops for the dynamo exporter's translation table, ``g.op`` for the TorchScript exporter's symbolic. The dynamo
exporter without a table records the op's decomposition under ONNX export (msda_core.op), which is the gather
form in aten ops (msda_core.export). onnxscript and onnx are imported only when a table is built: msda-core
depends on torch alone, and the TorchScript exporter needs neither.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

import torch

FORMS = ("gather", "grid_sample", "tensorrt")
OPSET = 18  # of the translation table's functions; the dynamo exporter converts them to the opset asked for
MIN_OPSET = 16  # GridSample's first; the TorchScript symbolic is registered from here on
TRT_DOMAIN = "trt.plugins"
EXTRA = "pip install 'msda-core[onnx]'"
# ONNX TensorProto element types (the ONNX spec's numbers; onnxscript's ir.DataType has the same values)
FLOAT, INT32, INT64, FLOAT16, DOUBLE, BFLOAT16 = 1, 6, 7, 10, 11, 16
_SCALAR_TYPES = {"Float": FLOAT, "Int": INT32, "Long": INT64, "Half": FLOAT16, "Double": DOUBLE,
                 "BFloat16": BFLOAT16}  # TorchScript's names for them

_form: contextvars.ContextVar[str] = contextvars.ContextVar("msda_onnx_form", default="gather")


def _check_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    return form


def _require(module: str, entry: str):
    """Import an optional dependency, or say which extra installs it."""
    try:
        return __import__(module)
    except ImportError as error:
        raise ModuleNotFoundError(f"{entry} needs {module}, which is not installed: {EXTRA}") from error


def translation_table(form: str | None = None, *, plugin: str | None = None) -> dict:
    """``{torch.ops.msda.deform_attn.default: function}`` for the dynamo exporter's ``custom_translation_table``.

    Args:
        form: ``"gather"``, ``"grid_sample"`` or ``"tensorrt"`` (module docstring); None takes the innermost
            :func:`export_form` block's, else ``"gather"``.
        plugin: the former spelling: ``plugin="tensorrt"`` is ``form="tensorrt"``; None changes nothing.

    Returns:
        A dict for ``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``. Its function builds the
        form at opset 18, which the exporter converts to the ``opset_version`` asked for (16 or later).

    Raises:
        ValueError: an unknown form, or a plugin other than "tensorrt" (the message names ``form=``).
        ModuleNotFoundError: onnxscript (or, for "tensorrt", onnx) is not installed; the message names the extra.

    Example:
        >>> import torch, msda_core
        >>> table = msda_core.onnx.translation_table("gather")
        >>> list(table) == [torch.ops.msda.deform_attn.default]
        True
        >>> # then: torch.onnx.export(model, args, dynamo=True, custom_translation_table=table)
    """
    if plugin is not None:
        if plugin != "tensorrt" or form not in (None, "tensorrt"):
            raise ValueError(f"plugin: expected 'tensorrt' or None, got {plugin!r} (with form={form!r}); "
                             f"choose the graph with form= instead, one of {FORMS}")
        form = "tensorrt"
    build = _BUILDERS[_check_form(form or _form.get())]
    if build is _tensorrt_form:  # its node's schema
        _require("onnx", "msda_core.onnx.translation_table(form='tensorrt')")
    onnxscript = _require("onnxscript", "msda_core.onnx.translation_table")
    graph = _ScriptGraph(getattr(onnxscript, f"opset{OPSET}"))
    return {torch.ops.msda.deform_attn.default: lambda *args, **options: build(graph, *args)}


@contextlib.contextmanager
def export_form(form: str):
    """The graph form ``torch.onnx.export(..., dynamo=False)`` emits for the op inside this block (in this thread),
    and ``translation_table()``'s default.

    Args:
        form: ``"gather"`` (the default outside any block), ``"grid_sample"`` or ``"tensorrt"``.

    Raises:
        ValueError: an unknown form.

    Example:
        >>> import io, torch, msda_core
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, value, shapes, loc, weights):
        ...         return torch.ops.msda.deform_attn(value, shapes, None, loc, weights)
        >>> shapes = torch.tensor([[2, 3]])  # one level of 2 x 3 pixels
        >>> args = (torch.randn(1, 6, 2, 4), shapes, torch.rand(1, 5, 2, 1, 3, 2), torch.rand(1, 5, 2, 1, 3))
        >>> with msda_core.onnx.export_form("grid_sample"):
        ...     torch.onnx.export(Attention(), args, io.BytesIO(), dynamo=False)
    """
    token = _form.set(_check_form(form))
    try:
        yield
    finally:
        _form.reset(token)


def exporting() -> bool:
    """Whether one of torch's ONNX exporters is running; registers the TorchScript exporter's symbolic when one is.
    The op calls it (msda_core.op): costs a dict lookup when torch.onnx was never imported (no export can run then).

    Returns:
        ``torch.onnx.is_in_onnx_export()``, False while torch.onnx is not imported.

    Example:
        >>> import msda_core
        >>> msda_core.onnx.exporting()
        False
    """
    if "torch.onnx" not in sys.modules or not torch.onnx.is_in_onnx_export():
        return False
    _register_symbolic()
    return True


@functools.cache
def _register_symbolic():
    """Registered at the first export rather than at import: importing torch.onnx costs 25-60 ms."""
    torch.onnx.register_custom_op_symbolic("msda::deform_attn", _symbolic, MIN_OPSET)


def _symbolic(g, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *options):
    """The TorchScript exporter's translation: the form of the innermost export_form block (the options only pick
    backends)."""
    starts = None if level_start_index.node().mustBeNone() else level_start_index
    return _BUILDERS[_form.get()](_TorchScriptGraph(g), value, spatial_shapes, starts, sampling_locations,
                                  attention_weights)


class _Graph:
    """What a form builds with: ``op.Name(*inputs, **attributes)`` adds an ONNX node (Constant takes value_int,
    value_ints or value_float) of opset ``opset``; ``dtype`` (an ONNX element type) and ``shape`` (ints, None where
    dynamic) of a value; ``plugin`` adds TensorRT's node."""

    op: object
    opset: int

    def dtype(self, x) -> int:
        raise NotImplementedError

    def shape(self, x) -> tuple:
        raise NotImplementedError

    def plugin(self, value, shapes, starts, locations, weights):
        raise NotImplementedError


class _ScriptGraph(_Graph):
    """onnxscript's opset, traced by the dynamo exporter."""

    def __init__(self, op):
        self.op, self.opset = op, OPSET

    def dtype(self, x) -> int:
        return int(x.dtype)

    def shape(self, x) -> tuple:
        return tuple(d if isinstance(d, int) else None for d in x.shape)

    def plugin(self, value, shapes, starts, locations, weights):
        from onnxscript import values

        node = getattr(values.Opset(TRT_DOMAIN, 1), _plugin_schema())
        return node(value, shapes, starts, locations, weights, plugin_version="1")


class _TorchScriptOps:
    """``op.Name(...)`` as ``g.op("Name", ...)``, attributes suffixed with their kind as g.op wants them."""

    def __init__(self, g):
        self.g = g

    def Constant(self, value_int=None, value_ints=None, value_float=None):  # noqa: N802 (ONNX's name)
        if value_float is not None:
            return self.g.op("Constant", value_t=torch.tensor(value_float, dtype=torch.float32))
        return self.g.op("Constant", value_t=torch.tensor(value_int if value_ints is None else value_ints))

    def __getattr__(self, name):
        def node(*inputs, **attributes):
            kinds = {bool: "i", int: "i", float: "f", str: "s", list: "i", tuple: "i"}
            return self.g.op(name, *inputs, **{f"{k}_{kinds[type(v)]}": v for k, v in attributes.items()})
        return node


class _TorchScriptGraph(_Graph):
    """The TorchScript exporter's graph context."""

    def __init__(self, g):
        self.g, self.op, self.opset = g, _TorchScriptOps(g), g.opset

    def dtype(self, x) -> int:
        return _SCALAR_TYPES[x.type().scalarType()]

    def shape(self, x) -> tuple:
        return tuple(x.type().varyingSizes())

    def plugin(self, value, shapes, starts, locations, weights):
        return self.g.op(f"{TRT_DOMAIN}::MultiscaleDeformableAttnPlugin_TRT", value, shapes, starts, locations,
                         weights, plugin_version_s="1")


def _ints(graph, *values):
    return graph.op.Constant(value_ints=list(values))


def _scalar(graph, value):
    return graph.op.Constant(value_float=value) if isinstance(value, float) else graph.op.Constant(value_int=value)


def _cast(graph, x, dtype):
    return x if graph.dtype(x) == dtype else graph.op.Cast(x, to=dtype)


def _convert(graph, x, dtype, to):
    """x, of element type ``dtype``, in ``to`` (an intermediate's type is not known to every exporter)."""
    return x if dtype == to else graph.op.Cast(x, to=to)


def _dims(graph, x, *axes):
    """x's sizes along ``axes`` as a (len(axes),) int64 tensor, read at run time. (Shape's start and end would
    do for consecutive axes, but the TorchScript exporter's shape inference crashes on some graphs with them.)"""
    return graph.op.Gather(graph.op.Shape(x), _ints(graph, *axes), axis=0)


def _levels_and_points(graph, sampling_locations):
    L, P = graph.shape(sampling_locations)[3:5]
    if L is None or P is None:
        raise ValueError("sampling_locations: ONNX export needs static levels and points (dims 3 and 4 of "
                         f"(B, Q, M, L, P, 2)), got shape {graph.shape(sampling_locations)}")
    return L, P


def _level_tables(graph, spatial_shapes, level_start_index, levels, dtype):
    """(L, 2) sizes and (L,) starts in ``dtype``: the starts as given, else each level's the sum of the sizes H * W
    before it, as L - 1 Adds (TensorRT's CumSum takes float types only)."""
    op = graph.op
    shapes = _cast(graph, spatial_shapes, dtype)
    if level_start_index is not None:
        return shapes, _cast(graph, level_start_index, dtype)
    sizes = op.Mul(op.Gather(shapes, _scalar(graph, 0), axis=1), op.Gather(shapes, _scalar(graph, 1), axis=1))
    starts = [_convert(graph, _ints(graph, 0), INT64, dtype)]
    for level in range(1, levels):
        starts.append(op.Add(starts[-1], op.Gather(sizes, _ints(graph, level - 1), axis=0)))
    return shapes, op.Concat(*starts, axis=0)


def _compute_dtype(graph, value, sampling_locations):
    return DOUBLE if DOUBLE in (graph.dtype(value), graph.dtype(sampling_locations)) else FLOAT


def _gather_form(graph, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """msda_core.export.deform_attn_gather, node for node."""
    op = graph.op
    L, P = _levels_and_points(graph, sampling_locations)
    LP = L * P
    out_dtype, dtype = graph.dtype(value), _compute_dtype(graph, value, sampling_locations)
    value = _cast(graph, value, dtype)
    batch_queries_heads = _dims(graph, sampling_locations, 0, 1, 2)
    locations, weights = (  # folded to rank 5 first (CoreML's limit), then cast
        _convert(graph, op.Reshape(x, op.Concat(batch_queries_heads, _ints(graph, *tail), axis=0)), graph.dtype(x),
                 dtype) for x, tail in ((sampling_locations, (LP, 2)), (attention_weights, (LP,))))
    shapes, starts = _level_tables(graph, spatial_shapes, level_start_index, L, INT64)
    batch, pixels, heads, dim = (_dims(graph, value, axis) for axis in range(4))
    zeros = op.Expand(op.Cast(_scalar(graph, 0), to=dtype), op.Concat(batch, _ints(graph, 1), heads, dim, axis=0))
    rows = op.Reshape(op.Concat(value, zeros, axis=1),  # row S of each image: zeros (not Pad: the dynamo
                      op.Concat(_ints(graph, -1), dim, axis=0))  # exporter cannot convert Pad-18 to opsets 16, 17)
    sample_level = _ints(graph, *(level for level in range(L) for _ in range(P)))  # (L*P,)
    size = op.Gather(shapes, sample_level, axis=0)  # (L*P, 2)
    height, width = (op.Gather(size, _scalar(graph, axis), axis=1) for axis in (0, 1))
    start = op.Gather(starts, sample_level, axis=0)
    zero_row = op.Squeeze(pixels, _ints(graph, 0))  # S, the appended row's index
    first_row = op.Add(  # (B, 1, M, 1): b * (S + 1) * M + m
        op.Reshape(op.Mul(op.Range(_scalar(graph, 0), op.Squeeze(batch, _ints(graph, 0)), _scalar(graph, 1)),
                          op.Mul(op.Add(pixels, _ints(graph, 1)), heads)), _ints(graph, -1, 1, 1, 1)),
        op.Reshape(op.Range(_scalar(graph, 0), op.Squeeze(heads, _ints(graph, 0)), _scalar(graph, 1)),
                   _ints(graph, 1, 1, -1, 1)))
    half, one = (op.Cast(_scalar(graph, v), to=dtype) for v in (0.5, 1.0))
    x, y = (op.Sub(op.Mul(op.Gather(locations, _scalar(graph, axis), axis=4), op.Cast(length, to=dtype)), half)
            for axis, length in ((0, width), (1, height)))
    x0, y0 = op.Floor(x), op.Floor(y)
    fx, fy = op.Sub(x, x0), op.Sub(y, y0)
    width_f, height_f, minus_one, zero = (op.Cast(v, to=dtype) for v in (width, height, _scalar(graph, -1),
                                                                             _scalar(graph, 0)))
    out = None
    for dy in (0, 1):
        for dx in (0, 1):
            cx, cy = (op.Add(c0, one) if d else c0 for c0, d in ((x0, dx), (y0, dy)))
            # > -1 and < W rather than >= 0 and <= W - 1: a NaN compares False either way, so it is off the map
            on_map = op.And(op.And(op.Greater(cx, minus_one), op.Less(cx, width_f)),
                            op.And(op.Greater(cy, minus_one), op.Less(cy, height_f)))
            col, row = (op.Cast(op.Where(on_map, c, zero), to=INT64) for c in (cx, cy))
            pixel = op.Add(start, op.Add(op.Mul(row, width), col))
            inside = op.And(on_map, op.And(op.GreaterOrEqual(pixel, _scalar(graph, 0)), op.Less(pixel, zero_row)))
            pixel = op.Where(inside, pixel, zero_row)  # a wrong level table's pixel past the image: the zero row
            taps = op.Gather(rows, op.Add(op.Mul(pixel, heads), first_row), axis=0)  # (B, Q, M, L*P, D)
            w = op.Mul(op.Mul(weights, op.Sub(one, fy) if not dy else fy), op.Sub(one, fx) if not dx else fx)
            term = op.ReduceSum(op.Mul(taps, op.Unsqueeze(w, _ints(graph, -1))), _ints(graph, 3), keepdims=0)
            out = term if out is None else op.Add(out, term)
    out = op.Reshape(out, op.Concat(_dims(graph, locations, 0, 1), _ints(graph, -1), axis=0))
    return _convert(graph, out, dtype, out_dtype)


def _grid_sample_form(graph, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    op = graph.op
    L, _ = _levels_and_points(graph, sampling_locations)
    out_dtype, dtype = graph.dtype(value), _compute_dtype(graph, value, sampling_locations)
    if dtype == DOUBLE:
        raise TypeError("value: the grid_sample form computes in float32 (GridSample below opset 20 takes float "
                        "only), got float64 inputs; export with form='gather' instead")
    value, locations, weights = (_cast(graph, x, FLOAT) for x in (value, sampling_locations, attention_weights))
    shapes, starts = _level_tables(graph, spatial_shapes, level_start_index, L, INT64)
    batch, heads, dim = (_dims(graph, value, axis) for axis in (0, 2, 3))
    queries, points = (_dims(graph, locations, axis) for axis in (1, 4))
    rows = op.Mul(batch, heads)  # grid_sample's batch: one (b, m) per image
    value = op.Transpose(value, perm=[0, 2, 3, 1])  # (B, M, D, S)
    # 2 * loc - 1, clipped to +-3, far outside any map: the same zeros, and no huge coordinate reaches GridSample
    grid = op.Clip(op.Sub(op.Mul(locations, _scalar(graph, 2.0)), _scalar(graph, 1.0)),
                   _scalar(graph, -3.0), _scalar(graph, 3.0))
    grid = op.Reshape(op.Transpose(grid, perm=[0, 2, 3, 1, 4, 5]),  # (B*M, L, Q, P*2): rank 4
                      op.Concat(rows, _ints(graph, L), queries, op.Mul(points, _ints(graph, 2)), axis=0))
    weights = op.Reshape(op.Transpose(weights, perm=[0, 2, 3, 1, 4]),  # (B*M, L, 1, Q, P)
                         op.Concat(rows, _ints(graph, L, 1), queries, points, axis=0))
    total = None
    for level in range(L):
        size = op.Gather(shapes, _scalar(graph, level), axis=0)  # (2,): H, W
        start = op.Gather(starts, _ints(graph, level), axis=0)  # (1,)
        end = op.Add(start, op.Mul(op.Gather(size, _ints(graph, 0), axis=0), op.Gather(size, _ints(graph, 1), axis=0)))
        value_l = op.Reshape(op.Slice(value, start, end, _ints(graph, 3)), op.Concat(rows, dim, size, axis=0))
        grid_l = op.Reshape(op.Gather(grid, _scalar(graph, level), axis=1),
                            op.Concat(rows, queries, points, _ints(graph, 2), axis=0))
        sampled = op.GridSample(value_l, grid_l, align_corners=0, mode="linear" if graph.opset >= 20 else "bilinear",
                                padding_mode="zeros")
        weights_l = op.Gather(weights, _scalar(graph, level), axis=1)  # (B*M, 1, Q, P)
        term = op.ReduceSum(op.Mul(sampled, weights_l), _ints(graph, 3), keepdims=0)  # (B*M, D, Q)
        total = term if total is None else op.Add(total, term)
    out = op.Transpose(op.Reshape(total, op.Concat(batch, heads, dim, queries, axis=0)), perm=[0, 3, 1, 2])
    return _convert(graph, op.Reshape(out, op.Concat(batch, queries, _ints(graph, -1), axis=0)), FLOAT, out_dtype)


def _plugin_schema():
    """The plugin's inputs and output as an ONNX schema, registered once: the dynamo exporter builds nodes from
    schemas, and the checker and shape inference then know the node (its output takes value's type)."""
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


def _tensorrt_form(graph, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    dtype = graph.dtype(value)
    if dtype not in (FLOAT, FLOAT16):
        raise TypeError(f"value: TensorRT's MultiscaleDeformableAttnPlugin_TRT takes float32 or float16, got ONNX "
                        f"element type {dtype}; export with form='gather' (standard ops) instead")
    L, _ = _levels_and_points(graph, sampling_locations)
    shapes, starts = _level_tables(graph, spatial_shapes, level_start_index, L, INT32)
    locations, weights = (_cast(graph, x, dtype) for x in (sampling_locations, attention_weights))
    out = graph.plugin(value, shapes, starts, locations, weights)
    return graph.op.Reshape(out, graph.op.Concat(_dims(graph, locations, 0, 1), _ints(graph, -1),
                                                 axis=0))


_BUILDERS = {"gather": _gather_form, "grid_sample": _grid_sample_form, "tensorrt": _tensorrt_form}

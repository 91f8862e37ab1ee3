"""``msda::deform_attn`` as plain aten ops, for ``torch.export`` consumers (ExecuTorch, LiteRT, coremltools).

    program = torch.export.export(model, args).run_decompositions(msda_core.export.decomposition_table())

leaves no msda op in the program: each call becomes the gather backend's arithmetic written with the most common
ops (index_select, floor, where, mul, sum), which those converters know. For converters that trace the model
themselves (``openvino.convert_model(module)``, coremltools on ``torch.jit.trace``, ``litert_torch.convert(model)``)

    with msda_core.export.portable():
        tool.convert(model, ...)

makes them record the same arithmetic. It is also what ``torch.onnx.export(model, args)`` (the dynamo exporter, no
translation table) records, and what msda_core.onnx's ``"gather"`` form builds from ONNX ops:

- each sample's pixel coordinates ``x = loc_x * W_l - 0.5``, ``y = loc_y * H_l - 0.5`` (align_corners=False) and its
  four corners, weighted ``(1 - fx)(1 - fy)``, ``fx (1 - fy)``, ``(1 - fx) fy``, ``fx fy`` times its attention weight;
- ``value`` with one row of zeros appended to each image's pixels (row S), read as (B*(S+1)*M, D) rows; a corner
  off its map, a location that is not finite, or a wrong level table's pixel outside the image, reads that zero
  row, so no index leaves ``value`` and an inf or NaN
  pixel off the map changes nothing, while a non-finite location or weight still makes its output row NaN (the
  op's rule, README "Non-finite inputs");
- sums in float32 (float64 for float64 inputs), the output cast once to value's dtype.

Batch and query counts stay symbolic (no size is read as a Python int but L and P); level sizes and starts are
read from the tensors when the program runs. No tensor in it has more than 5 dimensions except the locations as
they come in, which the first reshape folds to (B, Q, M, L*P, 2).
"""

from __future__ import annotations

import torch

from .. import op
from ..registry import Inputs
from ..validation import check_inputs
from . import onnx


def deform_attn_gather(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor | None,
                       sampling_locations: torch.Tensor, attention_weights: torch.Tensor, *, backend: str = "auto",
                       grad_accum: str = "auto", deterministic: bool | None = None) -> torch.Tensor:
    """The op's forward as aten ops (the module docstring says which), with the op's signature; the keyword
    options only choose among backends, so they are accepted and have no effect.

    Args:
        value: (B, S, M, D), float16, bfloat16, float32 or float64.
        spatial_shapes: (L, 2) integer, (H, W) of each level.
        level_start_index: (L,) integer, or None for the exclusive cumulative sum of H * W.
        sampling_locations: (B, Q, M, L, P, 2) float, normalized (x, y).
        attention_weights: (B, Q, M, L, P) float.
        backend, grad_accum, deterministic: ignored (see above).

    Returns:
        (B, Q, M*D) in value's dtype, on value's device.

    Example:
        >>> import torch, msda_core
        >>> value, shapes = torch.randn(1, 6, 2, 4), torch.tensor([[2, 3]])
        >>> loc, weights = torch.rand(1, 5, 2, 1, 3, 2), torch.rand(1, 5, 2, 1, 3)
        >>> out = msda_core.export.deform_attn_gather(value, shapes, None, loc, weights)
        >>> torch.allclose(out, torch.ops.msda.deform_attn(value, shapes, None, loc, weights), atol=1e-6)
        True
    """
    B, S, M, D = value.shape
    Q, _, L, P = sampling_locations.shape[1:5]
    compute = torch.promote_types(torch.promote_types(value.dtype, sampling_locations.dtype), torch.float32)
    rows = torch.cat((value.to(compute), value.new_zeros((B, 1, M, D), dtype=compute)), 1).reshape(-1, D)  # row S: 0
    shapes = spatial_shapes.to(torch.int64)
    if level_start_index is None:  # each level's start the sum of the sizes before it, as L - 1 adds: ONNX
        sizes = shapes[:, 0] * shapes[:, 1]  # exporters turn cumsum into an int64 CumSum, which TensorRT lacks
        starts_list = [sizes[:1] * 0]  # not new_zeros: coremltools' conversion of it loses the integer dtype
        for level in range(1, L):
            starts_list.append(starts_list[-1] + sizes[level - 1 : level])
        starts = torch.cat(starts_list)
    else:
        starts = level_start_index.to(torch.int64)
    # each of the L*P samples' level: H, W and start, (L*P,)
    height, width = (shapes[:, axis, None].expand(L, P).reshape(L * P) for axis in (0, 1))
    start = starts[:, None].expand(L, P).reshape(L * P)
    locations = sampling_locations.reshape(B, Q, M, L * P, 2).to(compute)
    x = locations[..., 0] * width.to(compute) - 0.5  # (B, Q, M, L*P)
    y = locations[..., 1] * height.to(compute) - 0.5
    x0, y0 = x.floor(), y.floor()
    fx, fy = x - x0, y - y0
    weights = attention_weights.reshape(x.shape).to(compute)
    first_row = (torch.arange(B).view(B, 1, 1, 1) * (S + 1) * M + torch.arange(M).view(1, 1, M, 1)).to(value.device)
    out = None
    for dy in (0, 1):
        for dx in (0, 1):
            cx, cy = x0 + dx, y0 + dy
            # > -1 and < W rather than >= 0 and <= W - 1: a NaN compares False either way, so it is off the map
            on_map = (cx > -1) & (cx < width) & (cy > -1) & (cy < height)
            col, row = (torch.where(on_map, c, 0).to(torch.int64) for c in (cx, cy))
            pixel = start + row * width + col
            # a wrong level table can point past this image's rows: such a corner reads the zero row too (a Where
            # on a comparison, not a clamp, which ONNX exporters turn into an int64 Clip that TensorRT lacks)
            pixel = torch.where(on_map & (pixel >= 0) & (pixel < S), pixel, S)
            taps = rows.index_select(0, (pixel * M + first_row).reshape(-1)).view(*x.shape, D)
            w = weights * (fy if dy else 1 - fy) * (fx if dx else 1 - fx)
            term = (taps * w[..., None]).sum(3)  # (B, Q, M, D)
            out = term if out is None else out + term
    assert out is not None
    return out.reshape(B, Q, M * D).to(value.dtype)


def decomposition_table() -> dict:
    """torch.export's default decompositions with ``msda::deform_attn`` replaced by :func:`deform_attn_gather`.

    Returns:
        A dict for ``ExportedProgram.run_decompositions``: ``torch.export.default_decompositions()`` (the core aten
        set that ExecuTorch, LiteRT and coremltools take) plus ``{torch.ops.msda.deform_attn.default:
        deform_attn_gather}``.

    Raises:
        Nothing: it needs torch alone.

    Example:
        >>> import torch, msda_core
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, value, shapes, loc, weights):
        ...         return torch.ops.msda.deform_attn(value, shapes, None, loc, weights)
        >>> shapes = torch.tensor([[2, 3]])  # one level of 2 x 3 pixels
        >>> args = (torch.randn(1, 6, 2, 4), shapes, torch.rand(1, 5, 2, 1, 3, 2), torch.rand(1, 5, 2, 1, 3))
        >>> program = torch.export.export(Attention(), args)
        >>> program = program.run_decompositions(msda_core.export.decomposition_table())
        >>> any("msda" in str(node.target) for node in program.graph.nodes)
        False
        >>> torch.allclose(program.module()(*args), Attention()(*args), atol=1e-6)
        True
    """
    table = torch.export.default_decompositions()
    table[torch.ops.msda.deform_attn.default] = deform_attn_gather
    return table


def _while_exporting_to_onnx():
    """The op's hook (``msda_core.op.export_time_forward``): :func:`deform_attn_gather` while one of torch's ONNX
    exporters records the op (which also registers the TorchScript exporter's symbolic), else None. An eager call
    pays a dict lookup while torch.onnx was never imported."""
    return deform_attn_gather if onnx.exporting() else None


op.export_time_forward = _while_exporting_to_onnx


def portable() -> torch.overrides.TorchFunctionMode:
    """A block in which every call of ``msda::deform_attn`` computes as :func:`deform_attn_gather`: for converters
    that trace the model themselves and cannot convert msda's op, so that they record plain aten ops.

    ``torch.jit.trace`` records the op as one ``msda::deform_attn`` node before any of msda's code runs, and
    ``torch.export`` keeps it as one node (what AOTInductor compiles to the Triton kernels); converters built on
    them (``openvino.convert_model(module)``, coremltools through ``torch.jit.trace``, ``litert_torch.convert``,
    ultralytics' ``export(format="openvino" | "coreml" | "litert")``) then meet an op they do not know, or lower
    the CPU backend's bit arithmetic. Inside this block the call is replaced where the model makes it (a
    ``torch.overrides.TorchFunctionMode``), after the op's input checks, so every tracer records the gather
    arithmetic. Eager calls inside compute the same numbers (the CPU default backend's arithmetic) with plain ops.
    Not needed for ``torch.onnx.export`` (either exporter), nor for a program built with
    :func:`decomposition_table`.

    Returns:
        A context manager (enter it with ``with``), one per call; it applies to the thread that enters it.

    Raises:
        Inside the block, what the op raises for bad inputs (TypeError, ValueError naming the argument).

    Example:
        >>> import torch, msda_core
        >>> class Attention(torch.nn.Module):
        ...     def forward(self, value, shapes, loc, weights):
        ...         return torch.ops.msda.deform_attn(value, shapes, None, loc, weights)
        >>> shapes = torch.tensor([[2, 3]])  # one level of 2 x 3 pixels
        >>> args = (torch.randn(1, 6, 2, 4), shapes, torch.rand(1, 5, 2, 1, 3, 2), torch.rand(1, 5, 2, 1, 3))
        >>> with msda_core.export.portable():
        ...     traced = torch.jit.trace(Attention(), args)
        >>> any(node.kind().startswith("msda::") for node in traced.graph.nodes())
        False
        >>> torch.allclose(traced(*args), Attention()(*args), atol=1e-6)
        True
    """
    return _Portable()


class _Portable(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.msda.deform_attn.default or func is torch.ops.msda.deform_attn:
            check_inputs(Inputs(*args[:5], **{name: kwargs[name] for name in Inputs._fields[len(args):]}))
            return deform_attn_gather(*args, **kwargs)
        return func(*args, **kwargs)

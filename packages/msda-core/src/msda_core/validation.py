"""Input validation for msda.deform_attn: the one place every check lives.

Checks run before any backend touches memory. Shape, dtype and device checks need only metadata, so they run
on every call, fake tensors included. The *values* of ``spatial_shapes`` and ``level_start_index`` are checked
only where reading them is free: tensors in CPU memory (``nn.Parameter`` and other subclasses included, not
fake or functional ones), outside torch.compile and torch.export. A CUDA
level table is never read (that would synchronize the host with the device on every call); the Triton kernels
instead mask every read to value's own rows, so a wrong table there gives a documented result, never an
out-of-bounds read (docs/math.md, "Level tables").
"""

from __future__ import annotations

import torch

from .registry import Inputs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
GRAD_ACCUM_MODES = ("auto", "native", "fp32")


def _shape_error(arg: str, expected: str, actual: torch.Tensor, origin: str = "") -> ValueError:
    return ValueError(f"{arg}: expected shape {expected}{origin}, got {tuple(actual.shape)}")


def check_tensor(arg: str, x) -> None:
    """TypeError naming ``arg`` where a tensor belongs and something else came (a list of tensors, say)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a tensor, got {type(x).__name__}")


def check_device(arg: str, tensor: torch.Tensor, device: torch.device, of: str = "value") -> None:
    """ValueError naming ``arg`` where ``tensor`` is not on ``device``, the device of the argument ``of``."""
    if tensor.device != device:
        raise ValueError(f"{arg}: expected device {device} (the device of {of}), got {tensor.device}")


def _dims(names: str, sizes: tuple) -> str:
    """Render '(B, Q, M) = (2, 5, 8)' so a message shows both the meaning and the numbers."""
    return f"({names}) = {tuple(sizes)}"


def _values_readable(device: torch.device, *tensors) -> bool:
    """Tensors on ``device`` that hold their values in CPU memory, outside tracing: reading them costs a few
    microseconds and no device sync. A subclass that redefines ``__torch_dispatch__`` (fake and functional tensors)
    may hold none. Under ``torch.jit.trace`` a read would be recorded in the graph (msda_core.export.portable's
    calls run there). The device is asked first: on CUDA that answers alone."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and not torch.jit.is_tracing() and all(
        type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ for t in tensors if t is not None)


def check_inputs(inputs: Inputs) -> None:
    """Raise ValueError/TypeError naming the first malformed argument, what was expected (and where each expected
    size came from) and what it got. ``level_start_index`` may be None. Runs on every call: each check reads a
    tensor's metadata once."""
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    if value.dim() != 4:
        raise _shape_error("value", "(B, S, M, D) with 4 dims", value)
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise _shape_error("spatial_shapes", "(L, 2)", spatial_shapes)
    B, S, M, D = value.shape
    L = spatial_shapes.shape[0]
    if L == 0:
        raise _shape_error("spatial_shapes", "(L, 2) with L >= 1", spatial_shapes)
    if sampling_locations.dim() != 6:
        raise _shape_error("sampling_locations", "(B, Q, M, L, P, 2) with 6 dims", sampling_locations)
    location_shape = sampling_locations.shape
    Q, P = location_shape[1], location_shape[4]
    expected_loc = (B, Q, M, L, P, 2)
    if location_shape != expected_loc:
        raise _shape_error("sampling_locations", _dims("B, Q, M, L, P, 2", expected_loc), sampling_locations,
                           " (B, M from value.shape, L = spatial_shapes.shape[0], Q, P its own)")
    expected_w = expected_loc[:5]
    if attention_weights.shape != expected_w:
        raise _shape_error("attention_weights", _dims("B, Q, M, L, P", expected_w), attention_weights,
                           " (B, M from value.shape, L = spatial_shapes.shape[0], Q, P from sampling_locations)")
    if level_start_index is not None and level_start_index.shape != (L,):
        raise _shape_error("level_start_index", _dims("L,", (L,)), level_start_index,
                           " (L = spatial_shapes.shape[0])")

    value_dtype, location_dtype = value.dtype, sampling_locations.dtype
    for arg, dtype in (("value", value_dtype), ("sampling_locations", location_dtype),
                       ("attention_weights", attention_weights.dtype)):
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{arg}: expected a floating dtype in {FLOAT_DTYPES}, got {dtype}")
    for arg, t in (("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        if t is not None and t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{arg}: expected dtype torch.int64 or torch.int32, got {t.dtype}")
    if location_dtype != value_dtype and not (value_dtype in HALF_DTYPES and location_dtype == torch.float32):
        raise TypeError(
            f"sampling_locations: expected the dtype of value ({value_dtype})"
            + (" or torch.float32" if value_dtype in HALF_DTYPES else "")
            + f", got {location_dtype}"
        )
    if attention_weights.dtype != location_dtype:
        raise TypeError(
            f"attention_weights: expected the dtype of sampling_locations ({location_dtype}), "
            f"got {attention_weights.dtype}"
        )

    device = value.device
    if sampling_locations.device == attention_weights.device != device:
        raise ValueError(f"value: expected device {sampling_locations.device} (the device of sampling_locations and "
                         f"attention_weights), got {device}")
    for arg, t in (("spatial_shapes", spatial_shapes), ("sampling_locations", sampling_locations),
                   ("attention_weights", attention_weights), ("level_start_index", level_start_index)):
        if t is not None:
            check_device(arg, t, device)

    if _values_readable(device, spatial_shapes, level_start_index):
        check_level_values(S, spatial_shapes, level_start_index)


def check_level_values(S: int, spatial_shapes: torch.Tensor, level_start_index) -> None:
    """The level table must describe value's S rows exactly. Reads the tensors (a device sync on CUDA: callers
    that read them anyway, like the grid_sample backend, check for free)."""
    shapes = spatial_shapes.tolist()
    for l, (h, w) in enumerate(shapes):
        if h <= 0 or w <= 0:
            raise ValueError(f"spatial_shapes: expected positive (H, W) for every level, got {(h, w)} at level {l}")
    starts = level_starts(shapes)
    total = starts[-1] + shapes[-1][0] * shapes[-1][1]
    if total != S:
        raise ValueError(
            f"spatial_shapes: expected sum(H_l * W_l) to equal S = value.shape[1] = {S}, got {total} from {shapes}"
        )
    if level_start_index is not None and level_start_index.tolist() != starts:
        raise ValueError(
            f"level_start_index: expected the exclusive cumulative sum of H_l * W_l from spatial_shapes, {starts}, "
            f"got {level_start_index.tolist()}"
        )


def level_starts(shapes: list) -> list:
    """Exclusive cumulative sum of H_l * W_l: where each level begins along S."""
    starts, offset = [], 0
    for h, w in shapes:
        starts.append(offset)
        offset += h * w
    return starts


def check_grad_accum(grad_accum: str) -> None:
    if grad_accum not in GRAD_ACCUM_MODES:
        raise ValueError(f"grad_accum: expected one of {GRAD_ACCUM_MODES}, got {grad_accum!r}")


def check_grad_output(grad_output, value, sampling_locations) -> None:
    expected = (*sampling_locations.shape[:2], value.shape[2] * value.shape[3])
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output: expected shape (B, Q, M*D) = {expected} (B, Q from sampling_locations, "
                         f"M, D from value), got {tuple(grad_output.shape)}")
    check_device("grad_output", grad_output, value.device)
    if not grad_output.is_floating_point():
        raise TypeError(f"grad_output: expected a floating dtype, got {grad_output.dtype}")

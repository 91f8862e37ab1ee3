"""Input validation for msda.deform_attn: the one place every check lives.

Checks run before any backend touches memory. Shape, dtype and device checks need only metadata, so
they also run inside the fake kernels; checks of the *values* of ``spatial_shapes`` and
``level_start_index`` need real tensors and are skipped when tracing with fake or meta tensors, and while
a CUDA graph is being captured (reading values would synchronize, which capture forbids; the eager calls
that must precede a capture have run them).
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
GRAD_ACCUM_MODES = ("auto", "native", "fp32")


def _shape_error(arg: str, expected: str, actual: torch.Tensor) -> ValueError:
    return ValueError(f"{arg}: expected shape {expected}, got {tuple(actual.shape)}")


def _dims(names: str, sizes: tuple) -> str:
    """Render '(B, Q, M) = (2, 5, 8)' so a message shows both the meaning and the numbers."""
    return f"({names}) = {tuple(sizes)}"


def _can_read_values(index_tensors) -> bool:
    """Real tensors, and no CUDA graph capture in progress (all tensors are on one device by then)."""
    for t in index_tensors:
        if t.is_meta or isinstance(t, FakeTensor):
            return False
    return not (index_tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())


def check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Raise ValueError/TypeError naming the first malformed argument. When all is well, return the
    level_start_index to run with: the one passed, else the int64 one derived when this version of
    spatial_shapes was read, else None where it is not known (fake tensors; CUDA graph capture, where a graph
    must derive it from the live spatial_shapes on each replay; inference tensors)."""
    tensors = {
        "value": value,
        "spatial_shapes": spatial_shapes,
        "sampling_locations": sampling_locations,
        "attention_weights": attention_weights,
    }
    if level_start_index is not None:
        tensors["level_start_index"] = level_start_index
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
    Q, P = sampling_locations.shape[1], sampling_locations.shape[4]
    expected_loc = (B, Q, M, L, P, 2)
    if tuple(sampling_locations.shape) != expected_loc:
        raise _shape_error("sampling_locations", _dims("B, Q, M, L, P, 2", expected_loc), sampling_locations)
    expected_w = (B, Q, M, L, P)
    if tuple(attention_weights.shape) != expected_w:
        raise _shape_error("attention_weights", _dims("B, Q, M, L, P", expected_w), attention_weights)
    if level_start_index is not None and tuple(level_start_index.shape) != (L,):
        raise _shape_error("level_start_index", _dims("L,", (L,)), level_start_index)

    for arg in ("value", "sampling_locations", "attention_weights"):
        if tensors[arg].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{arg}: expected a floating dtype in {FLOAT_DTYPES}, got {tensors[arg].dtype}")
    for arg in ("spatial_shapes", "level_start_index"):
        if arg in tensors and tensors[arg].dtype not in INDEX_DTYPES:
            raise TypeError(f"{arg}: expected dtype torch.int64 or torch.int32, got {tensors[arg].dtype}")
    if attention_weights.dtype != sampling_locations.dtype:
        raise TypeError(
            f"attention_weights: expected the dtype of sampling_locations ({sampling_locations.dtype}), "
            f"got {attention_weights.dtype}"
        )
    mixed_ok = value.dtype in HALF_DTYPES and sampling_locations.dtype == torch.float32
    if sampling_locations.dtype != value.dtype and not mixed_ok:
        raise TypeError(
            f"sampling_locations: expected the dtype of value ({value.dtype})"
            + (" or torch.float32" if value.dtype in HALF_DTYPES else "")
            + f", got {sampling_locations.dtype}"
        )

    device = value.device
    for arg, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{arg}: expected device {device} (the device of value), got {t.device}")

    index_tensors = (spatial_shapes,) if level_start_index is None else (spatial_shapes, level_start_index)
    if not _can_read_values(index_tensors):
        return level_start_index
    if not _already_checked(S, spatial_shapes, level_start_index):
        starts = _check_level_values(S, spatial_shapes, level_start_index)
        _remember_checked(S, spatial_shapes, level_start_index, starts)
    if level_start_index is not None:
        return level_start_index
    return _checked_levels.get(id(spatial_shapes), (None, None))[1]  # just checked: no entry only if unversioned


# Reading spatial_shapes on CUDA synchronizes with the device, so each live index tensor is read once
# per version: id(spatial_shapes) -> ((S, its version, level_start_index's id and version), starts), where
# starts is the level_start_index derived from the values read when none was passed (else None). A live
# object keeps its id, any in-place write bumps its version, and the entry goes when the tensor does.
# Tensors made under torch.inference_mode() have no version counter: they are read on every call.
_checked_levels: dict = {}


def _level_key(S, spatial_shapes, level_start_index):
    starts = None if level_start_index is None else (id(level_start_index), level_start_index._version)
    return S, spatial_shapes._version, starts


def _versioned(spatial_shapes, level_start_index) -> bool:
    return not (spatial_shapes.is_inference() or (level_start_index is not None and level_start_index.is_inference()))


def _already_checked(S, spatial_shapes, level_start_index) -> bool:
    entry = _checked_levels.get(id(spatial_shapes))
    return (_versioned(spatial_shapes, level_start_index) and entry is not None
            and entry[0] == _level_key(S, spatial_shapes, level_start_index))


def _remember_checked(S, spatial_shapes, level_start_index, starts: list) -> None:
    if not _versioned(spatial_shapes, level_start_index):
        return
    key = id(spatial_shapes)
    if key not in _checked_levels:
        weakref.finalize(spatial_shapes, _checked_levels.pop, key, None)
    if level_start_index is not None:  # its id must not be reused while the entry names it
        weakref.finalize(level_start_index, _checked_levels.pop, key, None)
    derived = None if level_start_index is not None else torch.tensor(starts, device=spatial_shapes.device)
    _checked_levels[key] = (_level_key(S, spatial_shapes, level_start_index), derived)


def _check_level_values(S: int, spatial_shapes: torch.Tensor, level_start_index) -> list:
    """The level table must describe value's S rows exactly, or a kernel would read past them. Returns
    the level starts the shapes imply."""
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
            f"level_start_index: expected the exclusive cumulative sum of H_l * W_l, {starts}, "
            f"got {level_start_index.tolist()}"
        )
    return starts


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

"""Drop-in replacements for the functions existing code calls for multi-scale deformable attention.

Each keeps the signature users call today (Deformable DETR's ``MSDeformAttnFunction.apply``, mmcv's and
detrex's ``multi_scale_deformable_attn_pytorch``, transformers' module-level functions) and runs
``torch.ops.msda.deform_attn``, so ``use_backend``, ``MSDA_BACKEND`` and ``backend=`` choose the kernel.
They also accept what those callers pass: level shapes as a tensor or a list of (H, W), locations with
the (L, P) axes folded into one, and the dtypes autocast leaves behind. ``install_extension_shim`` (the
stand-ins for compiled extensions, in ``shims``) is also reached from here, where users have always called it.
"""

from __future__ import annotations

import operator

import torch

from .. import op  # noqa: F401  (registers torch.ops.msda)
from ..validation import HALF_DTYPES, check_tensor
from .shims import install_extension_shim as install_extension_shim  # users call it as compat's

_SHAPES: dict = {}  # (shapes, device) -> int64 tensor: one tensor per pyramid, copied to the device once


def level_shapes(shapes, device, arg: str = "value_spatial_shapes") -> torch.Tensor:
    """``shapes`` as the (L, 2) tensor the op takes. A list of (H, W) becomes a tensor on ``device``, the same
    one on every call: a new one would be a host-to-device copy, which waits for the device, on every call.
    A list must hold at least one pair of integers (``arg`` names it in errors); a tensor the op checks."""
    if isinstance(shapes, torch.Tensor):
        return shapes
    key = (_integer_pairs(shapes, arg), torch.device(device))
    if torch.compiler.is_compiling():
        return torch.tensor(key[0], dtype=torch.int64, device=device)
    if key not in _SHAPES:
        with torch.inference_mode(False):  # an inference tensor could not be saved for backward later
            tensor = torch.tensor(key[0], dtype=torch.int64, device=device)
        if type(tensor) is not torch.Tensor:  # made under a fake or tracing mode: good for this call only
            return tensor
        if len(_SHAPES) >= 4096:  # image sizes vary in training: bound the memo, as the registry does
            _SHAPES.clear()
        _SHAPES[key] = tensor
    return _SHAPES[key]


def _integer_pairs(shapes, arg: str) -> tuple:
    """A list of (H, W) as a tuple of int pairs, or a TypeError/ValueError naming ``arg``."""
    try:
        pairs = [tuple(pair) for pair in shapes]
    except TypeError:
        raise TypeError(f"{arg}: expected a tensor or a list of (H, W) pairs, got {shapes!r}") from None
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"{arg}: expected (H, W) pairs of one or more levels, got {shapes!r}")
    try:
        return tuple((operator.index(h), operator.index(w)) for h, w in pairs)
    except TypeError:
        raise TypeError(f"{arg}: expected integer sizes, got {shapes!r}") from None


def _unfold(sampling_locations, attention_weights, levels: int):
    """Locations (B, Q, M, L*P, 2) and weights (B, Q, M, L*P), level-major, as (B, Q, M, L, P, 2) and
    (B, Q, M, L, P)."""
    if levels < 1:
        raise ValueError("value_spatial_shapes: expected (H, W) of one or more levels, got none")
    if sampling_locations.dim() == 5:
        LP = sampling_locations.shape[3]
        if LP % levels:
            raise ValueError(f"sampling_locations: expected shape (B, Q, M, L*P, 2) with L*P a multiple of "
                             f"L = {levels}, got {tuple(sampling_locations.shape)}")
        sampling_locations = sampling_locations.unflatten(3, (levels, LP // levels))
    if attention_weights.dim() == 4 and sampling_locations.dim() == 6:
        L, P = sampling_locations.shape[3:5]
        if attention_weights.shape[3] != L * P:
            raise ValueError(f"attention_weights: expected shape (B, Q, M, L*P) with L*P = {L * P} (from "
                             f"sampling_locations), got {tuple(attention_weights.shape)}")
        attention_weights = attention_weights.unflatten(3, (L, P))
    return sampling_locations, attention_weights


def _op_dtypes(value, sampling_locations, attention_weights):
    """Casts to a dtype pair the op takes: locations in value's dtype, or fp32 beside a half value (autocast
    can leave fp32 locations beside bf16 weights, where the PyTorch path promotes); weights as locations.
    Floating dtypes only: an integer, bool or complex tensor would lose its meaning in the cast."""
    for arg, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if not t.is_floating_point():
            raise TypeError(f"{arg}: expected a floating dtype, got {t.dtype}")
    location_dtype = sampling_locations.dtype
    if location_dtype != value.dtype and not (value.dtype in HALF_DTYPES and location_dtype == torch.float32):
        location_dtype = torch.float32 if value.dtype in HALF_DTYPES else value.dtype
    return sampling_locations.to(location_dtype), attention_weights.to(location_dtype)


def run_op(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
           backend: str = "auto") -> torch.Tensor:
    """The op, after the conversions above; (B, Q, M*D). Every replacement in this package ends here."""
    for arg, x in (("value", value), ("sampling_locations", sampling_locations),
                   ("attention_weights", attention_weights)):
        check_tensor(arg, x)
    spatial_shapes = level_shapes(spatial_shapes, value.device)
    sampling_locations, attention_weights = _unfold(sampling_locations, attention_weights, spatial_shapes.shape[0])
    sampling_locations, attention_weights = _op_dtypes(value, sampling_locations, attention_weights)
    return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, backend=backend)


class MSDeformAttnFunction:
    """Deformable DETR's ``MSDeformAttnFunction`` (mmcv's and detrex's ``MultiScaleDeformableAttnFunction``):
    call ``.apply``. Not an ``autograd.Function``: the op has its own autograd."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
              im2col_step=None, *, backend: str = "auto") -> torch.Tensor:
        """im2col_step is accepted and ignored: the op has no batch chunking and no divisibility rule."""
        return run_op(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                      backend=backend)


MultiScaleDeformableAttnFunction = MSDeformAttnFunction  # mmcv, detrex
MultiScaleDeformableAttentionFunction = MSDeformAttnFunction  # the transformers hub kernel's layer name


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights, *,
                                        backend: str = "auto") -> torch.Tensor:
    """mmcv's, detrex's and ultralytics' pure-PyTorch function: shapes a tensor or a list of (H, W); locations
    (B, Q, M, L, P, 2) or level-major (B, Q, M, L*P, 2), weights (B, Q, M, L, P) or (B, Q, M, L*P)."""
    return run_op(value, value_spatial_shapes, None, sampling_locations, attention_weights, backend=backend)


ms_deform_attn_core_pytorch = multi_scale_deformable_attn_pytorch  # Deformable DETR, Mask2Former
multi_scale_deformable_attention = multi_scale_deformable_attn_pytorch  # transformers' mask2former, oneformer


def ms_deform_attn_core_pytorch_bmds(value, value_spatial_shapes, sampling_locations, attention_weights,
                                     value_spatial_shapes_hw=None, *, backend: str = "auto") -> torch.Tensor:
    """RF-DETR's (and LW-DETR's export) ``ms_deform_attn_core_pytorch``: ``value`` laid out (B, M, D, S), level
    shapes taken from the list of (H, W) ``value_spatial_shapes_hw`` when given; locations rank 6 or rank 5
    (levels and points folded), weights (B, Q, M, L*P)."""
    shapes = value_spatial_shapes if value_spatial_shapes_hw is None else value_spatial_shapes_hw
    return run_op(value.permute(0, 3, 1, 2), shapes, None, sampling_locations, attention_weights, backend=backend)


def v2_unsupported(num_points_list, method) -> str | None:
    """Why msda cannot serve a ``multi_scale_deformable_attention_v2`` call, or None when it can."""
    if method != "default":
        return f"method={method!r}: msda samples bilinearly (method='default') only"
    if len(set(num_points_list)) > 1:
        return f"num_points_list={list(num_points_list)}: msda needs the same number of points on every level"
    return None


def multi_scale_deformable_attention_v2(value, value_spatial_shapes, sampling_locations, attention_weights,
                                        num_points_list, method="default", *, backend: str = "auto") -> torch.Tensor:
    """transformers' RT-DETRv2 / D-FINE / DEIMv2 function and the original RT-DETRv2 / D-FINE repositories'
    ``deformable_attention_core_func_v2``: value (B, S, M, D), or D-FINE's tuple of per-level (B, M, D, H_l*W_l);
    locations (B, Q, M, sum(P_l), 2), weights (B, Q, M, sum(P_l)). Only ``method="default"`` with equal P_l
    (ValueError otherwise)."""
    reason = v2_unsupported(num_points_list, method)
    if reason:
        raise ValueError(f"multi_scale_deformable_attention_v2: {reason}")
    levels = len(value_spatial_shapes)
    points = list(num_points_list)
    if len(points) != levels or sampling_locations.dim() != 5 or sum(points) != sampling_locations.shape[3]:
        raise ValueError(f"num_points_list: expected one count per level ({levels}) summing to sum(P_l) of "
                         f"sampling_locations (B, Q, M, sum(P_l), 2) = {tuple(sampling_locations.shape)}, got {points}")
    if isinstance(value, (list, tuple)):
        value = torch.cat(value, dim=-1).permute(0, 3, 1, 2)
    return run_op(value, value_spatial_shapes, None, sampling_locations, attention_weights, backend=backend)


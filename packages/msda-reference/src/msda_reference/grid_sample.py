"""The ``grid_sample`` backend: one ``F.grid_sample`` per level, on any device and dtype.

The bilinear sample of docs/math.md is exactly ``grid_sample(bilinear, zeros, align_corners=False)`` at grid
``2 * loc - 1``. Half inputs are computed in float32 (the reference of low-precision results, and the
mixed half-value/fp32-location case, must not lose the locations' precision). Autograd is off inside an
op's implementation, so the backward calls aten's ``grid_sampler_2d_backward`` directly.

Non-finite locations: aten's CPU kernel samples NaN there, its CUDA kernel 0. This backend moves such
points outside the map before aten sees them and writes NaN into their samples itself, so every device
follows the convention all backends share (docs/math.md, "Non-finite inputs"): a sample is NaN where its pixel
coordinate ``loc * W`` (or ``loc * H``) in the compute dtype is not finite, and an output row is NaN where one
of its attention weights is not. Huge finite points (|grid| > 3: every corner off the map) are moved outside
the map too, so aten never converts an out-of-range coordinate to an integer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from msda_core import Backend
from msda_core.validation import check_level_values

_BILINEAR, _ZEROS = 0, 0  # aten's enum values for mode="bilinear", padding_mode="zeros"


def compute_dtype(value, sampling_locations):
    return torch.promote_types(torch.promote_types(value.dtype, sampling_locations.dtype), torch.float32)


def pixels_finite(spatial_shapes, sampling_locations, dtype):
    """(B, Q, M, L, P): whether both pixel coordinates, loc * (W, H) in ``dtype``, are finite. A location
    whose coordinate overflows is as a non-finite one (the Triton kernels scale in fp32)."""
    size = spatial_shapes.flip(-1).to(dtype)[:, None, :]  # (L, 1, 2): (W, H)
    return torch.isfinite(sampling_locations.to(dtype) * size).all(-1)


_OUTSIDE = -4.0  # a grid coordinate far outside [-1, 1]: zeros padding gives 0 and no gradient


def _per_level(inputs):
    """Yield, per level: value as (B*M, D, H, W), grid as (B*M, Q, P, 2) with non-finite and far points
    moved outside the map, the mask of finite points (B*M, 1, Q, P) and weights as (B*M, Q, P)."""
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    B, S, M, D = value.shape
    Q, P = sampling_locations.shape[1], sampling_locations.shape[4]
    dtype = compute_dtype(value, sampling_locations)
    check_level_values(S, spatial_shapes, level_start_index)  # it reads the table anyway: the check is free
    finite = pixels_finite(spatial_shapes, sampling_locations, dtype)
    for l, ((H, W), start) in enumerate(zip(spatial_shapes.tolist(), level_start_index.tolist())):
        value_l = value[:, start:start + H * W].to(dtype).permute(0, 2, 3, 1).reshape(B * M, D, H, W)
        grid_l = 2 * sampling_locations[:, :, :, l].to(dtype).permute(0, 2, 1, 3, 4).reshape(B * M, Q, P, 2) - 1
        finite_l = finite[:, :, :, l].permute(0, 2, 1, 3).reshape(B * M, Q, P)
        near_l = (grid_l.abs() <= 3).all(-1)  # False for NaN too
        grid_l = torch.where(near_l[..., None], grid_l, _OUTSIDE)
        weights_l = attention_weights[:, :, :, l].to(dtype).permute(0, 2, 1, 3).reshape(B * M, Q, P)
        yield l, (start, H, W), value_l, grid_l, finite_l[:, None], weights_l


def _sample(value_l, grid_l, finite_l):
    """The bilinear samples (B*M, D, Q, P); NaN where the location was not finite."""
    sampled = F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False)
    return sampled.masked_fill(~finite_l, torch.nan)


def forward(inputs):
    B, S, M, D = inputs.value.shape
    Q = inputs.sampling_locations.shape[1]
    out = None
    for _, _, value_l, grid_l, finite_l, weights_l in _per_level(inputs):
        sampled = _sample(value_l, grid_l, finite_l)
        term = (sampled * weights_l[:, None]).sum(-1)  # (B*M, D, Q)
        term += (weights_l - weights_l).sum(-1)[:, None]  # a non-finite weight: NaN over its output row
        out = term if out is None else out + term
    return out.reshape(B, M, D, Q).permute(0, 3, 1, 2).reshape(B, Q, M * D).to(inputs.value.dtype).contiguous()


def backward(grad_output, inputs, grad_accum, deterministic):
    value, spatial_shapes, _, sampling_locations, attention_weights = inputs
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    dtype = compute_dtype(value, sampling_locations)
    g = grad_output.to(dtype).reshape(B, Q, M, D).permute(0, 2, 3, 1).reshape(B * M, D, Q, 1)
    grad_value = torch.zeros(value.shape, dtype=dtype, device=value.device)
    grad_locations, grad_weights = [], []
    for _, (start, H, W), value_l, grid_l, finite_l, weights_l in _per_level(inputs):
        sampled = _sample(value_l, grid_l, finite_l)
        grad_weights.append((g * sampled).sum(1))  # (B*M, Q, P)
        grad_value_l, grad_grid_l = torch.ops.aten.grid_sampler_2d_backward(
            g * weights_l[:, None], value_l, grid_l, _BILINEAR, _ZEROS, False, [True, True])
        grad_value[:, start:start + H * W] = grad_value_l.reshape(B, M, D, H * W).permute(0, 3, 1, 2)
        grad_locations.append(2 * grad_grid_l)  # d(grid)/d(loc) = 2
    grad_locations = torch.stack(grad_locations, 1).reshape(B, M, L, Q, P, 2).permute(0, 3, 1, 2, 4, 5)
    grad_weights = torch.stack(grad_weights, 1).reshape(B, M, L, Q, P).permute(0, 3, 1, 2, 4)
    # a non-finite location's sample is NaN, so are both components of its gradient (every backend)
    finite = pixels_finite(spatial_shapes, sampling_locations, dtype)[..., None]
    grad_locations = torch.where(finite, grad_locations, torch.nan)
    return (grad_value.to(value.dtype), grad_locations.to(sampling_locations.dtype).contiguous(),
            grad_weights.to(attention_weights.dtype).contiguous())


BACKEND = Backend(
    name="grid_sample",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    auto_devices=frozenset({"cpu", "cuda"}),
    reproducible_on=frozenset({"cpu"}),  # aten's CUDA backward scatters with atomicAdd
    priority=10,
)

"""Bilinear knots: the locations where a sample's pixel coordinate is an integer, and the convention every backend
keeps there, written out as the compiled extension's arithmetic (Deformable DETR's and mmcv's CUDA op).

Deformable DETR, DINO and mmdet initialise ``sampling_offsets`` so that every encoder sample sits on a pixel
centre plus whole pixels, i.e. on knots, where the location gradient jumps. The extension computes, in the
locations' precision (fp32 for fp32 inputs), ``x = loc_x * W - 0.5`` (a product, then a difference: two
roundings), ``x0 = floor(x)``, and takes corners x0 and x0 + 1: at a knot (x integer) the derivative is the
one-sided one towards the higher pixel. One difference at the map's edge: the extension skips a sample unless
-1 < x < W and -1 < y < H, so at exactly x = -1 (or y = -1) its sample and gradients are 0; msda keeps such a
sample in (it reads 0 there too), and its location gradient is the same one-sided derivative, towards pixel 0.
``extension_rule`` below keeps msda's edge and the extension's arithmetic everywhere else.
"""

from __future__ import annotations

import math

import torch

from .cases import grad_output_for, upcast
from .compare import assert_close
from .parity import GRAD_NAMES, grad_value_effect, run
from .tolerances import tolerance


def model_init_inputs(levels, heads: int = 8, points: int = 2, head_dim: int = 2, dtype=torch.float32) -> dict:
    """An encoder at Deformable DETR's initialisation, computed in ``dtype`` as a model computes it: a query per
    pixel of every level, its reference point that pixel's centre, ``linspace(0.5, W - 0.5, W) / W`` (in
    ``dtype``), on every level; head m's offset (cos, sin)(2 pi m / M) scaled to unit max-norm, times p + 1, in
    pixels of each level, divided by (W_l, H_l) and added in ``dtype``. On power-of-two levels every sample on
    its own level is an exact knot in fp32 and fp64; elsewhere the fp32 sums land within an ulp or two of one."""
    g = torch.Generator().manual_seed(0)
    shapes = torch.tensor(levels, dtype=torch.int64)
    centres = []
    for h, w in levels:
        ys = torch.linspace(0.5, h - 0.5, h, dtype=dtype) / h
        xs = torch.linspace(0.5, w - 0.5, w, dtype=dtype) / w
        y, x = torch.meshgrid(ys, xs, indexing="ij")
        centres.append(torch.stack((x, y), -1).reshape(-1, 2))
    reference = torch.cat(centres)  # (Q, 2)
    Q, L = reference.shape[0], len(levels)
    angle = torch.arange(heads, dtype=torch.float64) * (2 * math.pi / heads)
    direction = torch.stack((angle.cos(), angle.sin()), -1)
    direction = (direction / direction.abs().amax(-1, keepdim=True)).round(decimals=12)  # cos(pi/2) = 6e-17 -> 0
    offset = direction.reshape(heads, 1, 1, 2) * torch.arange(1, points + 1, dtype=torch.float64).reshape(1, 1, -1, 1)
    size = shapes.flip(-1).to(dtype).reshape(1, L, 1, 2)  # (W, H)
    locations = reference.reshape(1, Q, 1, 1, 1, 2) + (offset.to(dtype).expand(heads, L, points, 2) / size)[None, None]
    value = torch.randn(1, int(shapes.prod(1).sum()), heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    weights = torch.rand(1, Q, heads, L, points, generator=g, dtype=torch.float64).to(dtype)
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    return {"value": value, "spatial_shapes": shapes, "level_start_index": starts,
            "sampling_locations": locations.contiguous(), "attention_weights": weights}


def coordinates(locations: torch.Tensor, size: int) -> torch.Tensor:
    """``loc * size - 0.5`` as the extension computes it: in the locations' own precision, two roundings."""
    return locations * size - 0.5


def extension_rule(inputs: dict, grad_output: torch.Tensor | None = None) -> dict:
    """Output and the three gradients in float64 from coordinates rounded as the extension rounds them (see the
    module docstring), for finite locations: the knot convention every backend must follow."""
    value, locations, weights = inputs["value"], inputs["sampling_locations"], inputs["attention_weights"]
    grad_output = grad_output_for(inputs) if grad_output is None else grad_output
    B, S, M, D = value.shape
    Q, L, P = locations.shape[1], locations.shape[3], locations.shape[4]
    v = value.double().permute(0, 2, 1, 3)  # (B, M, S, D)
    g = grad_output.double().reshape(B, Q, M, D).permute(0, 2, 1, 3)  # (B, M, Q, D)
    out = torch.zeros(B, M, Q, D, dtype=torch.float64)
    grad_value = torch.zeros_like(v)
    grad_locations = torch.zeros(B, M, Q, L, P, 2, dtype=torch.float64)
    grad_weights = torch.zeros(B, M, Q, L, P, dtype=torch.float64)
    for l, ((H, W), start) in enumerate(zip(inputs["spatial_shapes"].tolist(), inputs["level_start_index"].tolist())):
        loc = locations[:, :, :, l].permute(0, 2, 1, 3, 4)  # (B, M, Q, P, 2)
        x, y = coordinates(loc[..., 0], W), coordinates(loc[..., 1], H)
        inside = (x >= -1) & (x < W) & (y >= -1) & (y < H)  # msda's edge (the extension's is x > -1)
        x0, y0 = x.floor(), y.floor()
        fx, fy = (x - x0).double(), (y - y0).double()  # exact: x and x0 are in the same precision
        a = weights[:, :, :, l].permute(0, 2, 1, 3).double()  # (B, M, Q, P)
        corners = []
        for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
            row, col = y0.long() + dy, x0.long() + dx
            valid = inside & (row >= 0) & (row < H) & (col >= 0) & (col < W)
            pixel = torch.where(valid, start + row * W + col, 0).reshape(B, M, Q * P, 1).expand(B, M, Q * P, D)
            corners.append((pixel, valid, torch.gather(v, 2, pixel).reshape(B, M, Q, P, D) * valid[..., None]))
        (_, _, v00), (_, _, v01), (_, _, v10), (_, _, v11) = corners
        w = [(1 - fx) * (1 - fy), fx * (1 - fy), (1 - fx) * fy, fx * fy]
        sample = sum(wc[..., None] * vc for wc, (_, _, vc) in zip(w, corners))  # (B, M, Q, P, D)
        out += (a[..., None] * sample).sum(3)
        gq = g[:, :, :, None, :]  # (B, M, Q, 1, D)
        grad_weights[:, :, :, l] = (gq * sample).sum(-1)
        d_dx = (v01 - v00) * (1 - fy)[..., None] + (v11 - v10) * fy[..., None]
        d_dy = (v10 - v00) * (1 - fx)[..., None] + (v11 - v01) * fx[..., None]
        grad_locations[:, :, :, l, :, 0] = torch.where(inside, a * W * (gq * d_dx).sum(-1), 0)
        grad_locations[:, :, :, l, :, 1] = torch.where(inside, a * H * (gq * d_dy).sum(-1), 0)
        for wc, (pixel, valid, _) in zip(w, corners):
            contribution = (a * wc * valid)[..., None] * gq  # (B, M, Q, P, D)
            grad_value.scatter_add_(2, pixel, contribution.reshape(B, M, Q * P, D))
    return {"output": out.permute(0, 2, 1, 3).reshape(B, Q, M * D),
            "grad_value": grad_value.permute(0, 2, 1, 3),
            "grad_sampling_locations": grad_locations.permute(0, 2, 1, 3, 4, 5),
            "grad_attention_weights": grad_weights.permute(0, 2, 1, 3, 4)}


def knot_count(inputs: dict) -> int:
    """How many in-map sample coordinates lie exactly on a knot (an integer x or y), as the extension rounds."""
    locations, count = inputs["sampling_locations"], 0
    for l, (H, W) in enumerate(inputs["spatial_shapes"].tolist()):
        for axis, size in ((0, W), (1, H)):
            c = coordinates(locations[:, :, :, l, :, axis], size)
            count += int(((c == c.floor()) & (c >= -1) & (c < size)).sum())
    return count


def assert_follows_the_extension(backend: str, inputs: dict) -> None:
    """``backend``'s output and three gradients against extension_rule, each by its dtype's entry (grad_value by
    the entry of how the backend accumulates it), location gradients on knots included (compare_results leaves
    those out, since in general either side is right)."""
    assert knot_count(inputs) > 0
    expected = extension_rule(upcast(inputs, inputs["value"].dtype, "cpu"))
    actual = run(inputs, backend, grad_output_for(inputs))
    dtype = inputs["value"].dtype
    assert_close("output", actual["output"], expected["output"], tolerance(dtype, "forward"))
    effects = {"grad_value": grad_value_effect(backend, inputs)}
    for name in GRAD_NAMES:
        assert_close(name, actual[name], expected[name], tolerance(dtype, effects.get(name, "gradient")))

"""mmcv's PyTorch formulation of the op, in plain PyTorch: the CPU bench's baseline and the published-formula
reference of msda-core's compat, module and patch tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mmcv_pytorch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """mmcv's PyTorch formulation (``multi_scale_deformable_attn_pytorch``), the CPU baseline: each level of
    value laid out as (B*M, D, H, W) and sampled with one F.grid_sample at 2 * loc - 1; level_start_index
    unused, as there (the levels follow each other)."""
    B, _, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    shapes = spatial_shapes.tolist()
    levels = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for level, (h, w) in enumerate(shapes):
        value_l = levels[level].flatten(2).transpose(1, 2).reshape(B * M, D, h, w)
        grid_l = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)  # (B*M, Q, P, 2)
        samples.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = attention_weights.transpose(1, 2).reshape(B * M, 1, Q, L * P)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1)  # (B*M, D, Q)
    return out.view(B, M * D, Q).transpose(1, 2).contiguous()

"""Modules whose forward calls a name and signature ``patch`` recognises, each with its own math, in a namespace
of their own (a name that verification sends back stays back for the process). The first three are forks msda
must not serve: grid coordinates in [-1, 1] with align_corners=True, locations in pixels, an output laid out
(B, M*D, Q). Each module's forward takes value (B, S, M, D), the level shapes, locations (B, Q, M, L, P, 2) in
[0, 1] and weights (B, Q, M, L, P), and calls its function as its codebase would."""

import torch
import torch.nn.functional as F
from published import deformable_attention
from torch import nn


def _shapes(value_spatial_shapes):
    return [tuple(s) for s in value_spatial_shapes.tolist()]


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    """The issue's fork: locations are grid coordinates in [-1, 1], sampled with align_corners=True."""
    shapes = _shapes(value_spatial_shapes)
    B, _, M, D = value.shape
    output = 0
    for level, (v, (h, w)) in enumerate(zip(value.split([h * w for h, w in shapes], dim=1), shapes)):
        pixels = v.permute(0, 2, 3, 1).reshape(B * M, D, h, w)
        grid = sampling_locations[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled = F.grid_sample(pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
        output = output + (sampled * attention_weights[:, :, :, level].transpose(1, 2).flatten(0, 1)[:, None]).sum(-1)
    return output.view(B, M * D, -1).transpose(1, 2)


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    """A fork taking locations in pixels of each level ((x, y) in [0, W] x [0, H])."""
    wh = value_spatial_shapes.flip(-1).to(sampling_locations.dtype)[:, None, :]  # (L, 1, 2): (W, H)
    return deformable_attention(value, _shapes(value_spatial_shapes), sampling_locations / wh, attention_weights)


class MSDeformAttnFunction:
    """A fork's Function whose output is laid out (B, M*D, Q)."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
              im2col_step):
        return deformable_attention(value, _shapes(value_spatial_shapes), sampling_locations,
                                    attention_weights).transpose(1, 2)


class AlignCorners(nn.Module):
    def forward(self, value, shapes, locations, weights):
        return ms_deform_attn_core_pytorch(value, shapes, 2 * locations - 1, weights)


class PixelUnits(nn.Module):
    def forward(self, value, shapes, locations, weights):
        return multi_scale_deformable_attn_pytorch(value, shapes, locations * shapes.flip(-1)[:, None], weights)


class ChannelsFirst(nn.Module):
    def forward(self, value, shapes, locations, weights):
        starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
        return MSDeformAttnFunction.apply(value, shapes, starts, locations, weights, 64).transpose(1, 2)


class MultiScaleDeformableAttnFunction(torch.autograd.Function):
    """A compiled extension's Function whose extension is not there: calling it raises."""

    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step):
        raise RuntimeError("the compiled extension is not built")


class Missing(nn.Module):
    def forward(self, value, shapes, locations, weights):
        return MultiScaleDeformableAttnFunction.apply(value, shapes, None, locations, weights, 64)


def multi_scale_deformable_attention(value, value_spatial_shapes, sampling_locations, attention_weights):
    """The published formula, which then draws from the random generator and zeroes its ``value`` in place: a
    verification run must do neither to the caller."""
    output = deformable_attention(value, _shapes(value_spatial_shapes), sampling_locations, attention_weights)
    torch.rand(())
    with torch.no_grad():
        value.zero_()
    return output


class SideEffects(nn.Module):
    def forward(self, value, shapes, locations, weights):
        return multi_scale_deformable_attention(value, shapes, locations, weights)


FORKS = {AlignCorners: "ms_deform_attn_core_pytorch", PixelUnits: "multi_scale_deformable_attn_pytorch",
         ChannelsFirst: "MSDeformAttnFunction"}

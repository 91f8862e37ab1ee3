"""Plain-PyTorch transcriptions of the published formulas (Deformable DETR, arXiv:2010.04159, eq. 2 and its
module), the references of the compat, module and patch tests, in float64."""

import torch
import torch.nn.functional as F
from msda_testkit import mmcv_pytorch


def deformable_attention(value, shapes, locations, weights):
    """value (B, S, M, D), shapes [(H, W)], locations (B, Q, M, L, P, 2) normalized (x, y), weights
    (B, Q, M, L, P) -> (B, Q, M*D): per level, bilinear samples with zeros outside (grid_sample at 2*loc - 1,
    align_corners=False), times the weights, summed over levels and points: the testkit's transcription of
    mmcv's function, the bench's CPU baseline."""
    return mmcv_pytorch(value, torch.tensor(shapes), None, locations, weights)


def checkpoint(d_model, n_levels, n_heads, n_points, seed=0):
    """A Deformable-DETR-layout state dict (the names and shapes of its MSDeformAttn), random float64 entries;
    offsets scaled to a few pixels so the samples land all over the maps, inside and out."""
    g = torch.Generator().manual_seed(seed)
    MLP = n_heads * n_levels * n_points

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return {
        "sampling_offsets.weight": rand(MLP * 2, d_model, scale=0.5), "sampling_offsets.bias": rand(MLP * 2, scale=2.0),
        "attention_weights.weight": rand(MLP, d_model, scale=0.3), "attention_weights.bias": rand(MLP, scale=0.3),
        "value_proj.weight": rand(d_model, d_model, scale=0.2), "value_proj.bias": rand(d_model, scale=0.1),
        "output_proj.weight": rand(d_model, d_model, scale=0.2), "output_proj.bias": rand(d_model, scale=0.1),
    }


def sampling_inputs(state, n_heads, n_levels, n_points, query, reference_points, input_flatten, shapes,
                    padding_mask=None):
    """The value (N, S, M, D), locations and weights that Deformable DETR's MSDeformAttn forward computes with the
    tensors of ``state``; ``shapes`` a list of (H, W); reference points (N, Len_q, L, 2) points or (..., 4) boxes
    (cx, cy, w, h)."""
    N, Len_q, C = query.shape
    S = input_flatten.shape[1]
    M, L, P = n_heads, n_levels, n_points
    value = F.linear(input_flatten, state["value_proj.weight"], state["value_proj.bias"])
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(N, S, M, C // M)
    offsets = F.linear(query, state["sampling_offsets.weight"], state["sampling_offsets.bias"])
    offsets = offsets.view(N, Len_q, M, L, P, 2)
    weights = F.linear(query, state["attention_weights.weight"], state["attention_weights.bias"])
    weights = weights.view(N, Len_q, M, L * P).softmax(-1).view(N, Len_q, M, L, P)
    if reference_points.shape[-1] == 2:  # offsets in pixels of each level: divide by (W_l, H_l)
        wh = torch.tensor([(w, h) for h, w in shapes], dtype=query.dtype)
        locations = reference_points[:, :, None, :, None, :] + offsets / wh[None, None, None, :, None, :]
    else:  # offsets in half-box units per point
        ref = reference_points[:, :, None, :, None, :]
        locations = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5
    return value, locations, weights


def msdeformattn(state, n_heads, n_levels, n_points, query, reference_points, input_flatten, shapes,
                 padding_mask=None):
    """Deformable DETR's MSDeformAttn forward with the tensors of ``state`` (arguments as sampling_inputs)."""
    value, locations, weights = sampling_inputs(state, n_heads, n_levels, n_points, query, reference_points,
                                                input_flatten, shapes, padding_mask)
    out = deformable_attention(value, shapes, locations, weights)
    return F.linear(out, state["output_proj.weight"], state["output_proj.bias"])

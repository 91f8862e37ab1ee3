"""Seeded inputs: the shapes people run (docs/math.md) and an edge-case catalog, one case per kernel assumption."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from msda_core import Inputs, output_shape
from msda_core.validation import level_starts

DETR_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))  # Deformable DETR at 800x1333, strides 8..64
DETR_S = sum(h * w for h, w in DETR_LEVELS)  # 22223
TINY_LEVELS = ((6, 4), (3, 2))  # the anchors' gradcheck levels
ARGUMENTS = Inputs._fields  # the op's five input tensors' names, in order
DIFFERENTIABLE = ("value", "sampling_locations", "attention_weights")  # the arguments that have gradients


@dataclass(frozen=True)
class Case:
    """One input configuration. ``layout`` names what is special about it (see make_inputs)."""

    name: str
    batch: int = 1
    queries: int = 2
    heads: int = 2
    head_dim: int = 2
    levels: tuple = TINY_LEVELS
    points: int = 2
    loc_range: tuple = (0.0, 1.0)
    # random | model_like | pixel_centres | map_corners | past_edges | away_from_pixels | nonfinite
    layout: str = "random"
    contiguous: bool = True
    pass_level_start: bool = True
    index_dtype: torch.dtype = torch.int64

    @property
    def spatial_size(self) -> int:
        return sum(h * w for h, w in self.levels)


EDGE_CASES = (
    Case("tiny"),
    Case("out_of_bounds", batch=2, queries=5, loc_range=(-0.5, 1.5)),
    Case("pixel_centres", queries=4, layout="pixel_centres"),
    Case("map_corners", queries=4, layout="map_corners"),
    Case("past_edges", queries=8, levels=((4, 8), (2, 2)), layout="past_edges"),
    Case("head_dim_1", head_dim=1),
    Case("head_dim_3", head_dim=3),
    Case("head_dim_71", head_dim=71, queries=3),
    Case("single_level_point_head", heads=1, levels=((5, 7),), points=1),
    Case("one_by_one_levels", levels=((1, 1), (4, 3), (1, 1)), loc_range=(-0.5, 1.5)),
    Case("non_contiguous", batch=2, queries=3, heads=3, head_dim=5, contiguous=False),
    Case("no_level_start", pass_level_start=False),
    Case("int32_shapes", index_dtype=torch.int32),
    Case("many_levels_points", levels=((7, 5), (4, 6), (2, 3), (1, 2), (3, 1)), points=5, queries=3),
    Case("empty_batch", batch=0),
    Case("empty_queries", queries=0),
    Case("nonfinite", batch=2, queries=4, layout="nonfinite"),
)

# Head dims the anchors test; the float64 gradcheck runs on these at the tiny shape.
GRADCHECK_HEAD_DIMS = (1, 2, 3, 30, 32, 64, 71)

STANDARD_CASES = (
    Case("decoder_b4_q300", batch=4, queries=300, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    Case("encoder_b2", batch=2, queries=DETR_S, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
    Case("encoder_b8", batch=8, queries=DETR_S, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
)

# Small versions of the standard shapes: the DETR level ratios at 1/8 scale, for CPU-side checks.
SMALL_CASES = (
    Case("decoder_small", batch=2, queries=50, heads=8, head_dim=32,
         levels=((13, 21), (7, 11), (4, 6), (2, 3)), points=4, loc_range=(-0.1, 1.1)),
    Case("encoder_small", batch=1, queries=13 * 21 + 7 * 11 + 4 * 6 + 2 * 3, heads=8, head_dim=32,
         levels=((13, 21), (7, 11), (4, 6), (2, 3)), points=4, loc_range=(-0.1, 1.1)),
)


def case(name: str) -> Case:
    for c in EDGE_CASES + STANDARD_CASES + SMALL_CASES:
        if c.name == name:
            return c
    raise KeyError(name)


def with_head_dim(c: Case, head_dim: int) -> Case:
    return replace(c, name=f"{c.name}_d{head_dim}", head_dim=head_dim)


def _model_like_locations(c: Case, g: torch.Generator) -> torch.Tensor:
    """Locations as Deformable DETR samples them at initialisation (loc_range is not used).

    Reference points: with one query per pixel (Q = S, the encoder) query i is pixel i of the levels in order,
    its reference that pixel's centre ((j + 0.5) / W_l, (i + 0.5) / H_l); otherwise (the decoder) uniform in
    [0, 1]^2. Offsets in pixels: head m points along (cos t, sin t), t = 2 pi m / M, scaled to unit max-norm,
    times p + 1 for point p, the same on every level, plus N(0, 1) pixel noise. Location = reference +
    offset / (W_l, H_l).
    """
    B, Q, M, L, P = c.batch, c.queries, c.heads, len(c.levels), c.points
    size = torch.tensor([(w, h) for h, w in c.levels], dtype=torch.float64).reshape(1, 1, 1, L, 1, 2)
    if Q == c.spatial_size:
        centres = []
        for h, w in c.levels:
            i, j = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                                  indexing="ij")
            centres.append(torch.stack(((j + 0.5) / w, (i + 0.5) / h), -1).reshape(h * w, 2))
        reference = torch.cat(centres).reshape(1, Q, 1, 1, 1, 2)
    else:
        reference = torch.rand(B, Q, 1, 1, 1, 2, generator=g, dtype=torch.float64)
    angle = 2 * math.pi * torch.arange(M, dtype=torch.float64) / M
    direction = torch.stack((angle.cos(), angle.sin()), -1)
    direction = direction / direction.abs().amax(-1, keepdim=True)
    points = torch.arange(1, P + 1, dtype=torch.float64).reshape(1, 1, 1, 1, P, 1)
    offset = direction.reshape(1, 1, M, 1, 1, 2) * points + torch.randn(B, Q, M, L, P, 2, generator=g,
                                                                         dtype=torch.float64)
    return reference + offset / size


def _locations(c: Case, g: torch.Generator) -> torch.Tensor:
    B, Q, M, L, P = c.batch, c.queries, c.heads, len(c.levels), c.points
    if c.layout == "model_like":
        return _model_like_locations(c, g)
    lo, hi = c.loc_range
    loc = lo + (hi - lo) * torch.rand(B, Q, M, L, P, 2, generator=g, dtype=torch.float64)
    if c.layout in ("pixel_centres", "map_corners", "past_edges", "away_from_pixels"):
        hw = torch.tensor([(w, h) for h, w in c.levels], dtype=torch.float64).reshape(1, 1, 1, L, 1, 2)
        if c.layout == "pixel_centres":  # x = loc*W - 0.5 lands exactly on an integer: fx = fy = 0
            loc = (torch.floor(loc * hw) + 0.5) / hw
        elif c.layout == "map_corners":  # exactly 0 or 1: the sample straddles the border
            loc = torch.randint(0, 2, loc.shape, generator=g).to(torch.float64)
        elif c.layout == "past_edges":  # half the coordinates exactly at x = -1 or x = W (y alike): the sample's
            # corners on that axis lie outside the map, but for x = -1's second one, of weight 0. Exact in every
            # dtype for power-of-two sizes
            edge = torch.where(torch.rand(loc.shape, generator=g) < 0.5, -0.5, hw + 0.5) / hw
            loc = torch.where(torch.rand(loc.shape, generator=g) < 0.5, edge, loc)
        else:  # fractions in [0.1, 0.9]: finite differences never cross a pixel (the gradient's kinks)
            pixel = torch.floor(loc * hw - 0.5)
            loc = (pixel + 0.5 + 0.1 + 0.8 * torch.rand(loc.shape, generator=g, dtype=torch.float64)) / hw
    elif c.layout == "nonfinite":
        flat = loc.view(-1, 2)
        n = flat.shape[0]
        for i, bad in enumerate((math.nan, math.inf, -math.inf, 1e30, -1e30)):  # huge: no int overflow
            flat[(7 * i + 3) % n, i % 2] = bad
    return loc


def make_inputs(c: Case, dtype=torch.float32, location_dtype=None, device="cpu", seed=0) -> dict:
    """Keyword arguments for msda.deform_attn: value ~ N(0, 1), weights softmax-normalized over (L, P).

    Values are drawn in float64 and rounded once to ``dtype``, so the same seed gives the same inputs
    up to rounding in every dtype. ``location_dtype`` (default: ``dtype``) sets locations and weights.
    """
    g = torch.Generator().manual_seed(seed)
    B, Q, M, D, L, P = c.batch, c.queries, c.heads, c.head_dim, len(c.levels), c.points
    location_dtype = location_dtype or dtype
    value = torch.randn(B, c.spatial_size, M, D, generator=g, dtype=torch.float64)
    loc = _locations(c, g)
    weights = torch.randn(B, Q, M, L * P, generator=g, dtype=torch.float64).softmax(-1).reshape(B, Q, M, L, P)
    shapes = torch.tensor(c.levels, dtype=c.index_dtype)
    starts = torch.tensor(level_starts(c.levels), dtype=c.index_dtype)
    inputs = {
        "value": value.to(dtype),
        "spatial_shapes": shapes,
        "level_start_index": starts if c.pass_level_start else None,
        "sampling_locations": loc.to(location_dtype),
        "attention_weights": weights.to(location_dtype),
    }
    if not c.contiguous:
        inputs = {k: _non_contiguous(v) for k, v in inputs.items()}
    return {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}


def _non_contiguous(t):
    """The same values, stored with a gap after every element, so strides differ from the contiguous ones."""
    if t is None or t.dim() == 0:
        return t
    wide = torch.empty(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    view = wide[..., 0]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def grad_output_for(inputs: dict, seed: int = 1) -> torch.Tensor:
    """A seeded N(0, 1) gradient of the output (B, Q, M*D), in value's dtype and on its device."""
    value = inputs["value"]
    shape = output_shape(value, inputs["sampling_locations"])
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(value.dtype).to(value.device)


def upcast(inputs: dict, dtype=torch.float64, device=None) -> dict:
    """The same inputs in a wider float dtype (index tensors untouched): the reference's inputs."""
    out = {}
    for k, v in inputs.items():
        if v is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.to(device) if (v is not None and device is not None) else v
    return out


def infinite_pixel_inputs(dtype=torch.float32) -> dict:
    """Keyword arguments for msda.deform_attn whose samples read +-inf pixels of ``value`` (README, "Non-finite
    inputs"): of the six queries (one level of 4x4, two heads of 4 channels, two points), the output rows of queries
    0-2 are +inf (a weight times +inf: at a pixel centre, between four pixels with weights 1/4, at weights exact in no
    dtype), query 3's -inf (negative attention weights), queries 4 and 5 NaN (a zero attention weight on an inf;
    -inf + inf). Half ``dtype`` comes with fp32 locations and weights."""
    g = torch.Generator().manual_seed(0)
    location_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    value = torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64)
    value[:, [0, 5]] = math.inf  # pixels (0, 0) and (1, 1), (y, x)
    value[:, 15] = -math.inf  # pixel (3, 3)
    centre = [[(x + 0.5) / 4, (y + 0.5) / 4] for y, x in ((1, 1), (0, 2), (3, 3))]  # bilinear weights 1 and 0
    locations = torch.tensor([
        [centre[0], centre[1]],  # +inf: weight 1 on pixel (1, 1), the corners of weight 0 finite
        [[0.25, 0.25], [0.25, 0.25]],  # between (0, 0), (0, 1), (1, 0), (1, 1): weights 1/4
        [[1 / 3, 1 / 3], centre[1]],
        [centre[0], centre[1]],  # -inf with negative attention weights
        [centre[0], centre[1]],  # NaN: a zero attention weight on an inf
        [centre[2], centre[0]],  # NaN: -inf + inf
    ], dtype=torch.float64)[None, :, None, None].expand(1, 6, 2, 1, 2, 2)
    weights = torch.rand(1, 6, 2, 1, 2, generator=g, dtype=torch.float64) + 0.1
    weights[:, 3] = -weights[:, 3]
    weights[:, 4, :, 0, 0] = 0.0
    return {"value": value.to(dtype), "spatial_shapes": torch.tensor([(4, 4)]), "level_start_index": None,
            "sampling_locations": locations.to(location_dtype).contiguous(),
            "attention_weights": weights.to(location_dtype)}

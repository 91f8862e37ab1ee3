"""The ``naive`` backend: the math of docs/math.md as scalar Python loops, in float64 (Python floats).

Correct by inspection and slow: meant for tiny inputs as the root of the chain of trust. The gradients
are docs/math.md's formulas written out, not autograd, so they check the formulas themselves.
"""

from __future__ import annotations

import math

import torch
from msda_core import Backend

from .grid_sample import compute_dtype, pixels_finite

MAX_WORK = 200_000  # B*Q*M*L*P*D sampled channels; beyond this the loops take seconds


def _coordinates(value, spatial_shapes, sampling_locations) -> list:
    """Pixel coordinates x = loc_x * W - 0.5, y = loc_y * H - 0.5 (align_corners=False), (B, Q, M, L, P, 2) as
    Python floats, rounded as the other backends and the compiled extension round them: in the op's compute
    precision (fp32 for fp32 inputs), a product then a difference. So on a knot, and next to one, every backend
    takes the same corners (msda_testkit.knots); the rest of the loops is float64."""
    dtype = compute_dtype(value, sampling_locations)
    size = spatial_shapes.flip(-1).to(dtype).reshape(1, 1, 1, -1, 1, 2)  # (W, H) per level
    return (sampling_locations.to(dtype) * size - 0.5).double().tolist()


def _corners(x: float, y: float, H: int, W: int):
    """Fractions and the four corners (row, col, weight) in order 00, 01, 10, 11 of the sample at pixel
    coordinates (x, y); a corner outside the map has row/col None (zeros padding)."""
    x0, y0 = math.floor(x), math.floor(y)
    fx, fy = x - x0, y - y0
    corners = []
    for dy, dx, weight in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)), (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
        r, c = y0 + dy, x0 + dx
        inside = 0 <= r < H and 0 <= c < W
        corners.append((r * W + c if inside else None, weight))
    return fx, fy, corners


def _levels(spatial_shapes, level_start_index):
    return [(h, w, s) for (h, w), s in zip(spatial_shapes.tolist(), level_start_index.tolist())]


def _finite_samples(value, spatial_shapes, sampling_locations):
    """[b][q][m][l][p]: whether the sample's pixel coordinates are finite in the compute dtype (docs/math.md,
    "Non-finite inputs": the one place the loops do not compute in float64, so all backends agree)."""
    return pixels_finite(spatial_shapes, sampling_locations, compute_dtype(value, sampling_locations)).tolist()


def forward(inputs):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    v = value.double().tolist()
    loc = _coordinates(value, spatial_shapes, sampling_locations)
    att = attention_weights.double().tolist()
    levels = _levels(spatial_shapes, level_start_index)
    finite = _finite_samples(value, spatial_shapes, sampling_locations)
    out = [[[[0.0] * D for _ in range(M)] for _ in range(Q)] for _ in range(B)]
    for b in range(B):
        for q in range(Q):
            for m in range(M):
                acc = out[b][q][m]
                for l, (H, W, start) in enumerate(levels):
                    for p in range(P):
                        (x, y), a = loc[b][q][m][l][p], att[b][q][m][l][p]
                        if not (finite[b][q][m][l][p] and math.isfinite(a)):  # the output row is NaN
                            acc[:] = [math.nan] * D
                            continue
                        _, _, corners = _corners(x, y, H, W)
                        for pixel, weight in corners:
                            if pixel is not None:
                                row = v[b][start + pixel][m]
                                for d in range(D):
                                    acc[d] += a * weight * row[d]
    return torch.tensor(out, dtype=torch.float64).reshape(B, Q, M * D).to(value.dtype)


def backward(grad_output, inputs, grad_accum, deterministic):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    v = value.double().tolist()
    loc = _coordinates(value, spatial_shapes, sampling_locations)
    att = attention_weights.double().tolist()
    g_all = grad_output.double().reshape(B, Q, M, D).tolist()
    levels = _levels(spatial_shapes, level_start_index)
    finite = _finite_samples(value, spatial_shapes, sampling_locations)
    g_value = [[[[0.0] * D for _ in range(M)] for _ in range(S)] for _ in range(B)]
    g_loc = [[[[[[0.0, 0.0] for _ in range(P)] for _ in range(L)] for _ in range(M)] for _ in range(Q)]
             for _ in range(B)]
    g_att = [[[[[0.0] * P for _ in range(L)] for _ in range(M)] for _ in range(Q)] for _ in range(B)]
    zero = [0.0] * D
    for b in range(B):
        for q in range(Q):
            for m in range(M):
                g = g_all[b][q][m]
                for l, (H, W, start) in enumerate(levels):
                    for p in range(P):
                        (x, y), a = loc[b][q][m][l][p], att[b][q][m][l][p]
                        if not finite[b][q][m][l][p]:
                            g_att[b][q][m][l][p] = math.nan
                            g_loc[b][q][m][l][p] = [math.nan, math.nan]
                            continue
                        fx, fy, corners = _corners(x, y, H, W)
                        v00, v01, v10, v11 = (v[b][start + px][m] if px is not None else zero for px, _ in corners)
                        def dot(u):
                            return sum(gd * ud for gd, ud in zip(g, u))
                        s = [sum(wc * vc[d] for (_, wc), vc in zip(corners, (v00, v01, v10, v11))) for d in range(D)]
                        g_att[b][q][m][l][p] = dot(s)
                        ds_dx = [(v01[d] - v00[d]) * (1 - fy) + (v11[d] - v10[d]) * fy for d in range(D)]
                        ds_dy = [(v10[d] - v00[d]) * (1 - fx) + (v11[d] - v01[d]) * fx for d in range(D)]
                        g_loc[b][q][m][l][p] = [a * W * dot(ds_dx), a * H * dot(ds_dy)]
                        for pixel, weight in corners:
                            if pixel is not None:
                                target = g_value[b][start + pixel][m]
                                for d in range(D):
                                    target[d] += a * weight * g[d]
    def as_tensor(x, like):
        return torch.tensor(x, dtype=torch.float64).reshape(like.shape).to(like.dtype)
    return as_tensor(g_value, value), as_tensor(g_loc, sampling_locations), as_tensor(g_att, attention_weights)


def _limits(meta):
    work = meta.batch * meta.queries * meta.heads * meta.levels * meta.points * meta.head_dim
    if work > MAX_WORK:
        return [f"too large for the naive Python loops ({work} sampled channels > {MAX_WORK})"]
    return []


BACKEND = Backend(
    name="naive",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    auto_devices=frozenset(),  # a test oracle: only when asked for by name
    reproducible_on=frozenset({"cpu"}),
    priority=0,
    limits=_limits,
)

"""Triton kernels of multi-scale deformable attention (OP.md has the math and the conventions).

Layout: a *row* is one (b, q, m) triple, r = (b * Q + q) * M + m. With contiguous inputs the row's
locations start at r * L * P * 2, its weights at r * L * P and its output at r * D; its head's pixel s
sits in value at ((b * S + s) * M + m) * D. Offsets are computed in int64, so no tensor size can wrap.
All arithmetic is fp32 whatever the storage dtype.
"""

import triton
import triton.language as tl


def launch_config(D: int, backward: bool) -> tuple:
    """(BLOCK_R, BLOCK_D, num_warps): the channel block covers D up to 64, rows fill ~2048 elements per
    program. The forward runs 2 warps, the backward 4: measured on the H200 (BENCHMARKS.md, encoder B2),
    2 warps cut the forward by 28% (fp32) and 11% (bf16) and slow the backward down to 1.8x."""
    block_d = min(triton.next_power_of_2(D), 64)
    return max(16, min(128, 2048 // block_d)), block_d, 4 if backward else 2


@triton.jit
def _corners(loc_ptr, weight_ptr, shapes_ptr, starts_ptr, rows, row_ok, level, point, L, P):
    """Load one sample per row and return its bilinear corners, sample weight and pixel coordinates.

    Corners are (pixel index into S, in-map mask, bilinear weight) in order 00, 01, 10, 11 (row, column).
    A non-finite coordinate is reported through ``finite`` and never becomes an address: coordinates
    outside [-1, W] x [-1, H] (NaN and inf included) are replaced by 0 before the integer conversion, and
    all their corners are masked off.
    """
    H = tl.load(shapes_ptr + 2 * level).to(tl.int32)
    W = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
    start = tl.load(starts_ptr + level).to(tl.int64)
    sample = rows * (L * P) + level * P + point
    loc_x = tl.load(loc_ptr + 2 * sample, mask=row_ok, other=0.0).to(tl.float32)
    loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=row_ok, other=0.0).to(tl.float32)
    a = tl.load(weight_ptr + sample, mask=row_ok, other=0.0).to(tl.float32)
    Wf = W.to(tl.float32)
    Hf = H.to(tl.float32)
    x = loc_x * Wf - 0.5  # align_corners=False: pixel centres at integer + 0.5 in normalized units
    y = loc_y * Hf - 0.5
    finite = (tl.abs(x) < float("inf")) & (tl.abs(y) < float("inf"))
    safe = (x >= -1.0) & (x <= Wf) & (y >= -1.0) & (y <= Hf) & row_ok
    x = tl.where(safe, x, 0.0)
    y = tl.where(safe, y, 0.0)
    x0f = tl.floor(x)
    y0f = tl.floor(y)
    fx = x - x0f
    fy = y - y0f
    x0 = x0f.to(tl.int32)
    y0 = y0f.to(tl.int32)
    in_x0 = safe & (x0 >= 0)
    in_x1 = safe & (x0 + 1 < W)
    in_y0 = y0 >= 0
    in_y1 = y0 + 1 < H
    p00 = start + (y0 * W + x0).to(tl.int64)
    return (p00, in_y0 & in_x0, (1.0 - fx) * (1.0 - fy),
            p00 + 1, in_y0 & in_x1, fx * (1.0 - fy),
            p00 + W, in_y1 & in_x0, (1.0 - fx) * fy,
            p00 + W + 1, in_y1 & in_x1, fx * fy,
            a, fx, fy, Wf, Hf, finite)


@triton.jit
def forward_kernel(value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, out_ptr,
                   n_rows, Q, S, M, D, L, P, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (i, j) computes rows [i*BLOCK_R, +BLOCK_R) and channels [j*BLOCK_D, +BLOCK_D)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    b = rows // M // Q  # no Q * M product: it could pass 2^31 in int32
    m = rows % M
    head_base = (b * S * M + m) * D  # value offset of pixel 0 of this row's head
    pixel_stride = M * D
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    any_nonfinite = tl.zeros((BLOCK_R,), dtype=tl.int1)
    for level in range(L):
        for point in range(P):
            (p00, m00, w00, p01, m01, w01, p10, m10, w10, p11, m11, w11,
             a, fx, fy, Wf, Hf, finite) = _corners(loc_ptr, weight_ptr, shapes_ptr, starts_ptr, rows, row_ok,
                                                  level, point, L, P)
            any_nonfinite = any_nonfinite | ~finite
            base = head_base[:, None] + d[None, :]
            v00 = tl.load(value_ptr + base + (p00 * pixel_stride)[:, None], mask=m00[:, None] & d_ok[None, :], other=0.0)
            v01 = tl.load(value_ptr + base + (p01 * pixel_stride)[:, None], mask=m01[:, None] & d_ok[None, :], other=0.0)
            v10 = tl.load(value_ptr + base + (p10 * pixel_stride)[:, None], mask=m10[:, None] & d_ok[None, :], other=0.0)
            v11 = tl.load(value_ptr + base + (p11 * pixel_stride)[:, None], mask=m11[:, None] & d_ok[None, :], other=0.0)
            acc += (a * w00)[:, None] * v00.to(tl.float32) + (a * w01)[:, None] * v01.to(tl.float32) \
                + (a * w10)[:, None] * v10.to(tl.float32) + (a * w11)[:, None] * v11.to(tl.float32)
    acc = tl.where(any_nonfinite[:, None], float("nan"), acc)  # grid_sample's NaN for a non-finite location
    out_offsets = rows[:, None] * D + d[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The deterministic mode scales contributions so that any element's sum stays within this: no int64
# overflow, with room for rounding; a single scaled term beyond it can only be inf/NaN's doing.
FIXED_POINT_LIMIT = tl.constexpr(2.0 ** 62)


@triton.jit
def _accumulate(ptr, contribution, mask, scale, FIXED_POINT: tl.constexpr):
    """Atomically add an fp32 tile into grad_value. FIXED_POINT: as int64 multiples of 1/scale, rounded
    to nearest; integer addition is associative, so the sum's bits do not depend on the order of the
    adds. A non-finite scaled term (only when grad_output or the weights hold inf/NaN, for which the
    caller's scale is 0) adds 0 instead of an undefined conversion."""
    if FIXED_POINT:
        scaled = contribution * scale
        scaled = tl.where(tl.abs(scaled) <= FIXED_POINT_LIMIT, tl.floor(scaled + 0.5), 0.0)
        tl.atomic_add(ptr, scaled.to(tl.int64), mask=mask, sem="relaxed")
    else:
        tl.atomic_add(ptr, contribution.to(ptr.dtype.element_ty), mask=mask, sem="relaxed")


@triton.jit
def backward_kernel(value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, grad_out_ptr,
                    grad_value_ptr, grad_loc_ptr, grad_weight_ptr, scale_ptr,
                    n_rows, Q, S, M, D, L, P, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                    FIXED_POINT: tl.constexpr):
    """Program i handles rows [i*BLOCK_R, +BLOCK_R) over all channels, so the three dot products
    <g, v_corner> complete inside it. grad_value is scattered with atomic adds in grad_value_ptr's dtype
    (the gradient's own dtype, or an fp32 scratch buffer: the caller's accumulation switch), or with
    FIXED_POINT as int64 fixed point at the scale in scale_ptr (the deterministic mode)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    b = rows // M // Q  # no Q * M product: it could pass 2^31 in int32
    m = rows % M
    head_base = (b * S * M + m) * D
    pixel_stride = M * D
    scale = 0.0
    if FIXED_POINT:
        scale = tl.load(scale_ptr)
    for level in range(L):
        for point in range(P):
            (p00, m00, w00, p01, m01, w01, p10, m10, w10, p11, m11, w11,
             a, fx, fy, Wf, Hf, finite) = _corners(loc_ptr, weight_ptr, shapes_ptr, starts_ptr, rows, row_ok,
                                                  level, point, L, P)
            gv00 = tl.zeros((BLOCK_R,), dtype=tl.float32)  # <g, v_corner> over all channels
            gv01 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            gv10 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            gv11 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_ok = d < D
                g = tl.load(grad_out_ptr + rows[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                            other=0.0).to(tl.float32)
                base = head_base[:, None] + d[None, :]
                o00 = base + (p00 * pixel_stride)[:, None]
                o01 = base + (p01 * pixel_stride)[:, None]
                o10 = base + (p10 * pixel_stride)[:, None]
                o11 = base + (p11 * pixel_stride)[:, None]
                k00 = m00[:, None] & d_ok[None, :]
                k01 = m01[:, None] & d_ok[None, :]
                k10 = m10[:, None] & d_ok[None, :]
                k11 = m11[:, None] & d_ok[None, :]
                gv00 += tl.sum(g * tl.load(value_ptr + o00, mask=k00, other=0.0).to(tl.float32), axis=1)
                gv01 += tl.sum(g * tl.load(value_ptr + o01, mask=k01, other=0.0).to(tl.float32), axis=1)
                gv10 += tl.sum(g * tl.load(value_ptr + o10, mask=k10, other=0.0).to(tl.float32), axis=1)
                gv11 += tl.sum(g * tl.load(value_ptr + o11, mask=k11, other=0.0).to(tl.float32), axis=1)
                _accumulate(grad_value_ptr + o00, (a * w00)[:, None] * g, k00, scale, FIXED_POINT)
                _accumulate(grad_value_ptr + o01, (a * w01)[:, None] * g, k01, scale, FIXED_POINT)
                _accumulate(grad_value_ptr + o10, (a * w10)[:, None] * g, k10, scale, FIXED_POINT)
                _accumulate(grad_value_ptr + o11, (a * w11)[:, None] * g, k11, scale, FIXED_POINT)
            grad_a = w00 * gv00 + w01 * gv01 + w10 * gv10 + w11 * gv11
            grad_x = a * Wf * ((1.0 - fy) * (gv01 - gv00) + fy * (gv11 - gv10))  # W_l: chain rule of loc * W
            grad_y = a * Hf * ((1.0 - fx) * (gv10 - gv00) + fx * (gv11 - gv01))
            grad_a = tl.where(finite, grad_a, float("nan"))
            grad_x = tl.where(finite, grad_x, float("nan"))
            grad_y = tl.where(finite, grad_y, float("nan"))
            sample = rows * (L * P) + level * P + point
            tl.store(grad_weight_ptr + sample, grad_a.to(grad_weight_ptr.dtype.element_ty), mask=row_ok)
            tl.store(grad_loc_ptr + 2 * sample, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=row_ok)
            tl.store(grad_loc_ptr + 2 * sample + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=row_ok)

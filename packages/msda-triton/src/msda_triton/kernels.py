"""Triton kernels of multi-scale deformable attention (docs/math.md has the math and the conventions).

Layout: a *row* is one (b, q, m) triple, r = (b * Q + q) * M + m. With contiguous inputs the row's
locations start at r * L * P * 2, its weights at r * L * P and its output at r * D; its head's pixel s
sits in value at ((b * S + s) * M + m) * D. Offsets are int64 (no tensor size can wrap), except in the
forward while every tensor has fewer than 2^30 elements (WIDE, backend.needs_int64_offsets).
All arithmetic is fp32 whatever the storage dtype.
"""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

FEW_ROWS = 2 ** 17  # B*Q*M rows below which the kernels take small blocks (launch_config)
# Compile options of every launch. FP fusion (a*b+c as one FMA, rounded once) is what the kernels were timed and
# their tolerances measured with; Triton 3.6-3.9 enable it by default and 3.10 will not, so it is asked for.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
# A sample's pixel coordinate is loc * W - 0.5 rounded twice, as the CUDA extension computes it, so that at a
# bilinear knot every backend takes the same corners (README, "Knots"). Fusion would round it once: the
# product is made with libdevice's mul_rn, which is never fused. Triton's interpreter has no mul_rn, and numpy
# never fuses, so there the plain product is the same number.
ROUNDED_PRODUCT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


def launch_config(D: int, backward: bool, value_fp32: bool = False, few_rows: bool = False,
                  half_atomics: bool = False) -> tuple:
    """(the kernel's block constexprs, num_warps). The channel block covers D up to 64; the backward loops over
    channel blocks. Chosen by timing CUDA-graph replays on the H200 (``python -m msda_benchmarks.tune``; the figures
    are in BENCHMARKS.md, "Launch rules"):
    - forward, many rows: 32 rows on 4 warps (8 from D > 32), head-major (_block_rows), one point per step;
    - forward, ``few_rows`` (B*Q*M < FEW_ROWS, too few programs to hide latency): 4 rows per program and, of
      each row, 2 points per step in fp32, 4 in fp16/bf16, so more loads are in flight per program;
    - backward with fp32 atomic adds: 16 rows on 4 warps; ``few_rows``: 4 rows on 1 warp (timed at D = 32; 2
      warps from D > 32, as the forward);
    - backward with fp16/bf16 atomic adds (``half_atomics``), many rows: up to 128 rows, 2048 elements per
      program; few rows as the fp32 rule (the decoder's 9600 rows made 150 programs of 64)."""
    block_d = min(triton.next_power_of_2(D), 64)
    if backward and half_atomics and not few_rows:
        return {"BLOCK_R": max(16, min(128, 2048 // block_d)), "BLOCK_D": block_d}, 4
    if backward and few_rows:
        return {"BLOCK_R": 4, "BLOCK_D": block_d}, 1 if block_d <= 32 else 2
    if backward:
        return {"BLOCK_R": 16, "BLOCK_D": block_d}, 4
    if few_rows:
        return ({"BLOCK_R": 4, "BLOCK_P": 2 if value_fp32 else 4, "BLOCK_D": block_d, "HEAD_MAJOR": False},
                1 if block_d <= 32 else 2)
    return {"BLOCK_R": 32, "BLOCK_P": 1, "BLOCK_D": block_d, "HEAD_MAJOR": True}, 4 if block_d <= 32 else 8


@triton.jit
def _block_rows(n_rows, Q, M, BLOCK_R: tl.constexpr, HEAD_MAJOR: tl.constexpr, WIDE: tl.constexpr):
    """This program's rows (int64 if WIDE, else int32) and their mask. Row-major: BLOCK_R consecutive rows, so
    (b, q) blocks with all M heads. HEAD_MAJOR: one (b, m) per program and BLOCK_R consecutive queries of it,
    consecutive programs walking the queries of one head: the samples an SM serves then come from one head's
    value, whose small levels stay in L1 (Nsight Compute, encoder B2 fp32: L1 hit rate 54% against 25%)."""
    program = tl.program_id(0)
    if WIDE:
        program = program.to(tl.int64)
    if HEAD_MAJOR:
        n_blocks = tl.cdiv(Q, BLOCK_R)
        head = program // n_blocks  # b * M + m
        q = (program % n_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        return ((head // M) * Q + q) * M + head % M, q < Q
    rows = program * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < n_rows


@triton.jit
def _head_start(rows, Q, S, M):
    """b * S * M + m for row r = (b * Q + q) * M + m: where pixel 0 of the row's head sits in a (B, S, M, ...)
    tensor, in units of its trailing dimensions. No Q * M product: it could pass 2^31 in int32."""
    return (rows // M // Q) * S * M + rows % M


@triton.jit
def _level_inside(H, W, start, S):
    """Whether a level of H x W pixels whose pixel 0 is row ``start`` of value lies inside value's rows [0, S):
    then every in-map corner of it (column in [0, W), row in [0, H), which _corners checks) is a row of value,
    and its pixel index fits the int32 arithmetic of _corners. The level table is not validated on the GPU, so
    each kernel takes W = 0 for a level where this is false: no column is then in the map, the level contributes
    nothing, and no table can make a kernel read or write outside value. One scalar test per level, not a
    compare per corner (BENCHMARKS.md, "The forward's regression")."""
    start = start.to(tl.int64)
    pixels = H.to(tl.int64) * W.to(tl.int64)
    return (start >= 0) & (start + pixels <= S) & (pixels < 2147483648)


@triton.jit
def _corners(loc_x, loc_y, H, W, start, ok):
    """The bilinear corners of samples at normalized (loc_x, loc_y) (masked by ``ok``) on a level of H x W pixels
    whose pixel 0 is row ``start`` of value: (p00, m00, m01, m10, m11, fx, fy, finite), where p00 is corner 00's
    pixel index into S (corners 01, 10, 11 are p00 + 1, + W, + W + 1), m the corners' masks, fx, fy the
    fractions (_bilinear's weights) and ``finite`` whether both coordinates are.

    A non-finite coordinate never becomes an address: coordinates outside [-1, W) x [-1, H) (NaN and inf
    included) are replaced by 0 before the integer conversion, and all their corners are masked off. At x = W
    both columns lie outside the map; at x = -1 the second is inside with weight 0, which grid_sample still
    multiplies (an inf there gives NaN), so -1 stays in. A corner is masked unless it lies in the map, which for
    a level that passed _level_inside makes it a row of value (the others have W = 0). The caller loads the
    locations and the level table: a helper given those pointers would make Inductor's analysis of the kernel
    count them as written (its results feed store addresses)."""
    Wf = W.to(tl.float32)
    Hf = H.to(tl.float32)
    if ROUNDED_PRODUCT:  # align_corners=False: pixel centres at integer + 0.5 in normalized units
        x = libdevice.mul_rn(loc_x, Wf) - 0.5
        y = libdevice.mul_rn(loc_y, Hf) - 0.5
    else:
        x = loc_x * Wf - 0.5
        y = loc_y * Hf - 0.5
    finite = (tl.abs(x) < float("inf")) & (tl.abs(y) < float("inf"))
    safe = (x >= -1.0) & (x < Wf) & (y >= -1.0) & (y < Hf) & ok
    x = tl.where(safe, x, 0.0)
    y = tl.where(safe, y, 0.0)
    x0f = tl.floor(x)
    y0f = tl.floor(y)
    x0 = x0f.to(tl.int32)
    y0 = y0f.to(tl.int32)
    in_x0 = safe & (x0 >= 0)
    in_x1 = safe & (x0 + 1 < W)
    in_y0 = y0 >= 0
    in_y1 = y0 + 1 < H
    p00 = start + (y0 * W + x0).to(start.dtype)
    return p00, in_y0 & in_x0, in_y0 & in_x1, in_y1 & in_x0, in_y1 & in_x1, x - x0f, y - y0f, finite


@triton.jit
def _bilinear(fx, fy):
    """The weights of corners 00, 01, 10, 11 (row, column) at fractions fx, fy."""
    return (1.0 - fx) * (1.0 - fy), fx * (1.0 - fy), (1.0 - fx) * fy, fx * fy


@triton.jit
def forward_kernel(value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, out_ptr,
                   n_rows, Q, S, M, D, L, P, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_MAJOR: tl.constexpr, WIDE: tl.constexpr):
    """Program (i, j) computes the rows of _block_rows(i) and channels [j*BLOCK_D, +BLOCK_D), level by level,
    BLOCK_P points of each row per step: the corners are [BLOCK_R, BLOCK_P, BLOCK_D] gathers, so the loads of
    BLOCK_R * BLOCK_P samples are in flight together. Offsets are int32 unless WIDE (launch_forward's choice).
    A non-finite location or weight makes its sample's weight NaN, and NaN times even a masked corner's 0 is NaN:
    the row's output is NaN (docs/math.md, "Non-finite inputs"). (A flag carried across the loop instead cost 1.5-1.8x
    in time at 4 warps: its layout differs from the gathers', so every step converted between the two.)"""
    rows, row_ok = _block_rows(n_rows, Q, M, BLOCK_R, HEAD_MAJOR, WIDE)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = (d < D)[None, None, :]
    base = (_head_start(rows, Q, S, M) * D)[:, None, None] + d[None, None, :]  # channel d of the head's pixel 0
    pixel_stride = M * D
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for level in range(L):
        H = tl.load(shapes_ptr + 2 * level).to(tl.int32)
        W = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
        start = tl.load(starts_ptr + level)
        W = tl.where(_level_inside(H, W, start, S), W, 0)  # a level outside value: no column is in the map
        start = start.to(rows.dtype)
        for p0 in range(0, P, BLOCK_P):
            point = p0 + tl.arange(0, BLOCK_P)[None, :]
            ok = row_ok[:, None] & (point < P)
            sample = rows[:, None] * (L * P) + level * P + point
            loc_x = tl.load(loc_ptr + 2 * sample, mask=ok, other=0.0).to(tl.float32)
            loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=ok, other=0.0).to(tl.float32)
            a = tl.load(weight_ptr + sample, mask=ok, other=0.0).to(tl.float32)
            p00, m00, m01, m10, m11, fx, fy, finite = _corners(loc_x, loc_y, H, W, start, ok)
            w00, w01, w10, w11 = _bilinear(fx, fy)
            a = tl.where(finite & (tl.abs(a) < float("inf")), a, float("nan"))  # an inf weight: a NaN row too
            p00 = base + (p00 * pixel_stride)[:, :, None]  # the corners' addresses, 01, 10, 11 relative to 00's
            v00 = tl.load(value_ptr + p00, mask=m00[:, :, None] & d_ok, other=0.0)
            v01 = tl.load(value_ptr + p00 + pixel_stride, mask=m01[:, :, None] & d_ok, other=0.0)
            v10 = tl.load(value_ptr + p00 + W * pixel_stride, mask=m10[:, :, None] & d_ok, other=0.0)
            v11 = tl.load(value_ptr + p00 + (W + 1) * pixel_stride, mask=m11[:, :, None] & d_ok, other=0.0)
            acc += tl.sum((a * w00)[:, :, None] * v00.to(tl.float32) + (a * w01)[:, :, None] * v01.to(tl.float32)
                          + (a * w10)[:, :, None] * v10.to(tl.float32) + (a * w11)[:, :, None] * v11.to(tl.float32),
                          axis=1)
    out_offsets = rows[:, None] * D + d[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < D)[None, :])


# (constexprs, num_warps) of the deterministic mode's helper kernels: one row per thread; 1024 elements a program.
ANCHOR_MASS_LAUNCH = ({"BLOCK_R": 128}, 4)
FIXED_POINT_FINISH_LAUNCH = ({"BLOCK": 1024}, 4)

# The deterministic mode's sums are exact while an element of grad_value receives fewer terms than this (Q*L*P
# bounds them): the backend refuses more, and a traced call with more (sizes unknown when it was traced) gets NaN.
MAX_EXACT_TERMS = tl.constexpr(2 ** 23)

# The deterministic mode counts each sample's |a| in units of max|a| / MASS_UNITS (rounded up, so a nonzero
# weight is at least one unit and a unit count also bounds how many terms an element receives).
MASS_UNITS = tl.constexpr(64.0)


@triton.jit
def anchor_mass_kernel(shapes_ptr, starts_ptr, loc_ptr, weight_ptr, weight_max_ptr, mass_ptr,
                       n_rows, Q, S, M, L, P, BLOCK_R: tl.constexpr):
    """For the deterministic mode's bound: mass[b, s, m] += ceil(|a| * MASS_UNITS / max|a|) for every sample
    whose first in-map corner (its 00 corner clamped into the map) is pixel s. Integer adds: deterministic.
    An element at pixel s receives terms only from samples anchored at s, s-1, s-W or s-W-1, so 4 * max(mass)
    bounds both its count of terms and its sum of |a| in units. One atomic per sample, not four."""
    rows, row_ok = _block_rows(n_rows, Q, M, BLOCK_R, HEAD_MAJOR=False, WIDE=True)
    head_start = _head_start(rows, Q, S, M)
    per_unit = MASS_UNITS / tl.load(weight_max_ptr).to(tl.float32)
    for level in range(L):
        H = tl.load(shapes_ptr + 2 * level).to(tl.int32)
        W = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
        start = tl.load(starts_ptr + level)
        W = tl.where(_level_inside(H, W, start, S), W, 0)  # a level outside value: no column is in the map
        start = start.to(rows.dtype)
        for point in range(P):
            sample = rows * (L * P) + level * P + point
            loc_x = tl.load(loc_ptr + 2 * sample, mask=row_ok, other=0.0).to(tl.float32)
            loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=row_ok, other=0.0).to(tl.float32)
            a = tl.load(weight_ptr + sample, mask=row_ok, other=0.0).to(tl.float32)
            p00, m00, m01, m10, m11, fx, fy, finite = _corners(loc_x, loc_y, H, W, start, row_ok)
            anchor = tl.where(m00, p00, tl.where(m01, p00 + 1, tl.where(m10, p00 + W, p00 + W + 1)))
            units = tl.ceil(tl.abs(a) * per_unit)
            units = tl.where(units < 2.0 ** 62, units, 0.0)  # NaN/inf weights: their scale is NaN anyway
            tl.atomic_add(mass_ptr + head_start + anchor * M, units.to(tl.int64), mask=m00 | m01 | m10 | m11,
                          sem="relaxed")


@triton.jit
def _pow2(e):
    """2.0 ** e, exactly, for an integer e clamped into [-126, 126]."""
    return ((tl.minimum(tl.maximum(e, -126), 126) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(x):
    """floor(log2(x)) of a positive normal fp32 x, read from its bits (exact, unlike log2)."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _fixed_point_scales(weight_max_ptr, grad_max_ptr, mass_max_ptr):
    """(scale, ratio) of the deterministic mode, powers of two. With units = 4 * max(mass), any element of
    grad_value has at most ``units`` terms and sum |term| <= bound = units * max|a| / MASS_UNITS * max|g|.
    scale * bound < 2^23, so the scaled terms rounded to integers sum below 2^24 in any order (an element
    has at most Q*L*P < 2^23 terms, each rounded up by at most 1/2): fp32 adds them exactly. The remainders,
    |r| <= 1/2, are scaled by ratio with ratio * units < 2^23: their integer sums are exact too. scale is NaN
    when the bound is not finite (every element of grad_value is then NaN), 1 when it is 0 (every term is 0)."""
    units = 4.0 * tl.load(mass_max_ptr).to(tl.float32)
    bound = units * (tl.load(weight_max_ptr).to(tl.float32) / MASS_UNITS) * tl.load(grad_max_ptr).to(tl.float32)
    scale = _pow2(22 - _exponent(bound))
    scale = tl.where(bound == 0.0, 1.0, tl.where(bound < float("inf"), scale, float("nan")))
    ratio = tl.where(units > 0.0, _pow2(22 - _exponent(units)), 1.0)
    return scale, ratio


@triton.jit
def _accumulate(grad_value_ptr, fraction_ptr, offsets, contribution, mask, scale, ratio, FIXED_POINT: tl.constexpr):
    """Atomically add an fp32 tile into grad_value. FIXED_POINT: split each scaled term into an integer and
    its remainder's integer multiple of 1/ratio; both sums stay exact (see _fixed_point_scales), so their
    bits do not depend on the order of the adds."""
    if FIXED_POINT:
        x = contribution * scale
        whole = tl.floor(x + 0.5)
        tl.atomic_add(grad_value_ptr + offsets, whole, mask=mask, sem="relaxed")
        tl.atomic_add(fraction_ptr + offsets, tl.floor((x - whole) * ratio + 0.5), mask=mask, sem="relaxed")
    else:
        tl.atomic_add(grad_value_ptr + offsets, contribution.to(grad_value_ptr.dtype.element_ty), mask=mask,
                      sem="relaxed")


@triton.jit
def fixed_point_finish_kernel(whole_ptr, fraction_ptr, weight_max_ptr, grad_max_ptr, mass_max_ptr, out_ptr, numel,
                              BLOCK: tl.constexpr):
    """grad_value = (whole + fraction / ratio) / scale in out's dtype: the exact sums, rounded once (the
    divisions are by powers of two). out may be whole_ptr itself."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    scale, ratio = _fixed_point_scales(weight_max_ptr, grad_max_ptr, mass_max_ptr)
    whole = tl.load(whole_ptr + offsets, mask=ok)
    fraction = tl.load(fraction_ptr + offsets, mask=ok)
    tl.store(out_ptr + offsets, ((whole + fraction / ratio) / scale).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def backward_kernel(value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, grad_out_ptr,
                    grad_value_ptr, fraction_ptr, grad_loc_ptr, grad_weight_ptr, weight_max_ptr, grad_max_ptr,
                    mass_max_ptr,
                    n_rows, Q, S, M, D, L, P, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                    FIXED_POINT: tl.constexpr):
    """Program i handles the rows of _block_rows(i) (row-major) over all channels, so the three dot products
    <g, v_corner> complete inside it. grad_value is scattered with atomic adds in grad_value_ptr's dtype
    (the gradient's own dtype, or an fp32 scratch buffer: the caller's accumulation switch), or with
    FIXED_POINT as exact sums of integers, in grad_value_ptr and fraction_ptr (the deterministic mode; the
    maxima behind its scales in weight_max_ptr, grad_max_ptr, mass_max_ptr)."""
    rows, row_ok = _block_rows(n_rows, Q, M, BLOCK_R, HEAD_MAJOR=False, WIDE=True)
    head_base = _head_start(rows, Q, S, M) * D
    pixel_stride = M * D
    scale = 1.0
    ratio = 1.0
    if FIXED_POINT:
        scale, ratio = _fixed_point_scales(weight_max_ptr, grad_max_ptr, mass_max_ptr)
        scale = tl.where(Q.to(tl.int64) * L * P < MAX_EXACT_TERMS, scale, float("nan"))
    for level in range(L):
        H = tl.load(shapes_ptr + 2 * level).to(tl.int32)
        W = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
        start = tl.load(starts_ptr + level)
        W = tl.where(_level_inside(H, W, start, S), W, 0)  # a level outside value: no column is in the map
        start = start.to(rows.dtype)
        for point in range(P):
            sample = rows * (L * P) + level * P + point
            loc_x = tl.load(loc_ptr + 2 * sample, mask=row_ok, other=0.0).to(tl.float32)
            loc_y = tl.load(loc_ptr + 2 * sample + 1, mask=row_ok, other=0.0).to(tl.float32)
            a = tl.load(weight_ptr + sample, mask=row_ok, other=0.0).to(tl.float32)
            p00, m00, m01, m10, m11, fx, fy, finite = _corners(loc_x, loc_y, H, W, start, row_ok)
            w00, w01, w10, w11 = _bilinear(fx, fy)
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
                o01 = o00 + pixel_stride
                o10 = o00 + W * pixel_stride
                o11 = o10 + pixel_stride
                k00 = m00[:, None] & d_ok[None, :]
                k01 = m01[:, None] & d_ok[None, :]
                k10 = m10[:, None] & d_ok[None, :]
                k11 = m11[:, None] & d_ok[None, :]
                gv00 += tl.sum(g * tl.load(value_ptr + o00, mask=k00, other=0.0).to(tl.float32), axis=1)
                gv01 += tl.sum(g * tl.load(value_ptr + o01, mask=k01, other=0.0).to(tl.float32), axis=1)
                gv10 += tl.sum(g * tl.load(value_ptr + o10, mask=k10, other=0.0).to(tl.float32), axis=1)
                gv11 += tl.sum(g * tl.load(value_ptr + o11, mask=k11, other=0.0).to(tl.float32), axis=1)
                _accumulate(grad_value_ptr, fraction_ptr, o00, (a * w00)[:, None] * g, k00, scale, ratio, FIXED_POINT)
                _accumulate(grad_value_ptr, fraction_ptr, o01, (a * w01)[:, None] * g, k01, scale, ratio, FIXED_POINT)
                _accumulate(grad_value_ptr, fraction_ptr, o10, (a * w10)[:, None] * g, k10, scale, ratio, FIXED_POINT)
                _accumulate(grad_value_ptr, fraction_ptr, o11, (a * w11)[:, None] * g, k11, scale, ratio, FIXED_POINT)
            grad_a = w00 * gv00 + w01 * gv01 + w10 * gv10 + w11 * gv11
            grad_x = a * W.to(tl.float32) * ((1.0 - fy) * (gv01 - gv00) + fy * (gv11 - gv10))  # chain rule of loc * W
            grad_y = a * H.to(tl.float32) * ((1.0 - fx) * (gv10 - gv00) + fx * (gv11 - gv01))
            grad_a = tl.where(finite, grad_a, float("nan"))
            grad_x = tl.where(finite, grad_x, float("nan"))
            grad_y = tl.where(finite, grad_y, float("nan"))
            tl.store(grad_weight_ptr + sample, grad_a.to(grad_weight_ptr.dtype.element_ty), mask=row_ok)
            tl.store(grad_loc_ptr + 2 * sample, grad_x.to(grad_loc_ptr.dtype.element_ty), mask=row_ok)
            tl.store(grad_loc_ptr + 2 * sample + 1, grad_y.to(grad_loc_ptr.dtype.element_ty), mask=row_ok)

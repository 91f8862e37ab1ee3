"""The ``gather`` backend: the CPU forward and backward, reading ``value`` in place as rows.

``value`` (B, S, M, D) is read as B*S*M rows of D channels, a view. Each of the R = B*Q*M outputs is a
weighted sum of T = 4*L*P rows, the corners of its samples (its taps). The forward sums them with
``F.embedding_bag(mode="sum")``, never materializing the gathered rows. The backward gathers the rows of
each tap to take their dot products with grad_output, from which the weight and location gradients
follow, and computes grad_value as the same sum transposed: the taps sorted stably by row, then one
``embedding_bag`` over grad_output's rows. Every sum runs in a fixed order, so the backward is bitwise
reproducible. Half inputs are summed in float32: the forward reads a half ``value`` in place (``_bags``); the
backward converts it to float32.

Off-map corners read, with weight 0, a pixel of ``value`` that holds no inf or NaN (the first of its first 64
that is finite in every batch and head; pixel 0 if none is): an inf or NaN pixel off the map changes nothing,
as in the other backends. A non-finite location or attention weight makes its output row NaN (docs/math.md,
"Non-finite inputs"). Small eager calls run on one thread: their elementwise work is too short to gain from a
second, and waits milliseconds for it when the other core is busy.

Tensor operations only, reading no tensor's values on the host, so tracing (torch.compile, export) sees
all of it. Every corner row lies within value's rows of its own (b, m), whatever the level table says.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from msda_core import Backend

from . import grid_sample

_OFF_MAP = -2.0  # where non-finite coordinates go: both corners of that axis off the map
_FINITE_SEARCH = 64  # off-map taps read the first pixel of value's first this many that is finite everywhere
_EXACT_INTEGERS = {torch.float32: 2 ** 24, torch.float64: 2 ** 53}  # of the compute dtypes
_INT32_LIMIT = 2 ** 31  # counts and indices at or past this need int64
# Eager calls of fewer taps than this run on one thread (BENCHMARKS.md, "CPU": a decoder call has 153K).
_ONE_THREAD_TAPS = 1 << 20
# Eager mode works through the query rows in chunks of about this many taps, so that temporaries of a few
# MB stay in cache instead of being freshly mapped and faulted in (BENCHMARKS.md, "CPU"); the
# corner rows gathered for the backward's dot products, D times larger, in smaller pieces.
# A traced graph takes all rows at once: its compiler fuses the elementwise work and plans the memory.
_CHUNK_TAPS = 1 << 19
_GATHER_TAPS = 1 << 14


def _chunks(rows: int, taps_per_row: int, taps_per_chunk: int) -> list:
    """[start, end) ranges covering range(rows) in chunks of about taps_per_chunk taps."""
    if torch.compiler.is_compiling():
        return [(0, rows)]
    step = max(1, taps_per_chunk // taps_per_row)
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def _index_dtype(n: int) -> torch.dtype:
    """The integer dtype for indices and counts up to n."""
    return torch.int32 if n < _INT32_LIMIT else torch.int64


@contextlib.contextmanager
def _sized_threads(taps: int):
    """One intra-op thread for a small eager call, restored after. torch's CPU builds run ops on OpenMP, whose
    thread count belongs to the calling thread: other threads' calls keep theirs."""
    threads = 1 if torch.compiler.is_compiling() or taps >= _ONE_THREAD_TAPS else torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _per_sample(per_level, P):
    """(..., L) -> (..., L*P): each level's entry repeated for its P points."""
    return per_level[..., None].expand(*per_level.shape, P).flatten(-2)


class _Taps:
    """The taps of a chunk of C query rows (C*M outputs), in the order (output, corner (dy, dx), sample).

    ``rows`` (C*M, 4, L*P): their rows of value viewed as (B*S*M, D); a corner off the map reads pixel
    ``finite_pixel`` of its head, with weight 0 (``off_tap`` > 0 there).
    ``axis`` (C*M, 2 corners, 2 axes (x, y), L*P): each corner's bilinear weight along each axis, 0 off the map.
    A non-finite location's corners are off the
    map; ``nan`` (C*M, L*P) is NaN there, else 0, for the results that must be NaN (its sample, its gradients).

    Every operation runs over contiguous blocks of L*P samples with per-level constants expanded to
    (L*P,), and none makes a bool: broadcasting a trailing (x, y) dimension, or masking with bools, runs
    several times slower per element on the CPU."""

    def __init__(self, value_shape, spatial_shapes, level_start_index, locations, batch, dtype, finite_pixel):
        B, S, M, _ = value_shape
        C, _, L, P, _ = locations.shape
        R, LP = C * M, L * P
        self.size = _per_sample(spatial_shapes.flip(-1).t().to(dtype), P)  # (2 axes, LP): W, then H
        # In-place steps wherever a temporary is not needed again: each fresh temporary of a few hundred KB is
        # memory the allocator maps and the CPU faults in anew (BENCHMARKS.md, "CPU").
        xy = locations.new_empty((R, 2, LP), dtype=dtype).copy_(locations.reshape(R, LP, 2).transpose(1, 2))
        xy.mul_(self.size).sub_(0.5)  # align_corners=False
        self.nan = (xy - xy).sum(1)
        frac = xy.nan_to_num_(_OFF_MAP, _OFF_MAP, _OFF_MAP)
        low = frac.floor()
        frac.sub_(low)
        # Corner coordinates in a dtype that holds every integer up to S, so also every pixel of every level
        exact = dtype if S < _EXACT_INTEGERS[dtype] else torch.float64
        low = low.to(exact)
        corner = torch.stack((low, low), 1)  # (R, 2 corners, 2 axes, LP): low, then low + 1
        corner[:, 1].add_(1)
        index = torch.minimum(corner, _per_sample(spatial_shapes.flip(-1).t().to(exact), P) - 1).clamp_(min=0)
        self.off_map = corner.sub_(index).abs_().to(dtype)
        # the weight (1 - frac, frac) where the corner is on the map; off it, off_map >= 1 >= the weight
        self.axis = torch.stack((frac, frac), 1)
        self.axis[:, 0].neg_().add_(1)
        self.axis.sub_(self.off_map).clamp_(min=0)
        index_dtype = _index_dtype(2 * B * S * M)
        # Each axis' off-map corners minus S: a tap's pixel is then negative when either of its corners is off
        # the map, which integer steps turn into finite_pixel (bool masks would cost 10x as much here).
        off = self.off_map.clamp(max=1).to(index_dtype).mul_(S)
        index = index.to(index_dtype)
        col = index[:, :, 0] - off[:, :, 0]  # (R, 2 corners, LP)
        row_start = torch.mul(index[:, :, 1], _per_sample(spatial_shapes[:, 1].to(index_dtype), P)).add_(
            _per_sample(level_start_index.to(index_dtype), P)).sub_(off[:, :, 1])
        pixel = (row_start[:, :, None] + col[:, None]).view(R, 4, LP)
        pixel = pixel.clamp_(-1, S - 1)  # a wrong level table still reads this (b, m)'s rows
        sign = pixel.bitwise_right_shift(torch.iinfo(index_dtype).bits - 1)  # -1 where negative, else 0
        self.off_tap = sign.bitwise_and_(finite_pixel.to(index_dtype) + 1)  # (R, 4, LP): > 0 off the map, else 0
        pixel.add_(self.off_tap)  # -1 -> finite_pixel
        head = batch.to(index_dtype).view(C, 1, 1) * (S * M) + torch.arange(M, dtype=index_dtype).view(1, M, 1)
        self.rows = pixel.view(C, M, 4 * LP).mul_(M).add_(head).view(R, 4, LP)

    def weights(self, attention_weights):
        """(C*M, 4, L*P): each tap's attention weight times its bilinear weight."""
        wx, wy = self.axis[:, :, 0], self.axis[:, :, 1]
        a = attention_weights.reshape(wx.shape[0], 1, -1)
        return ((a * wy)[:, :, None] * wx[:, None]).view(wx.shape[0], 4, -1)


def _flat(value, sampling_locations, attention_weights, dtype, table_dtype):
    """value as (B*S*M, D) rows in ``table_dtype``; locations and weights with one leading dimension of B*Q query
    rows, the weights in ``dtype``; the batch index of each query row; the pixel off-map taps read (_finite_pixel)."""
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    table = value.to(table_dtype).reshape(B * S * M, D)
    return (table, sampling_locations.reshape(B * Q, M, L, P, 2),
            attention_weights.to(dtype).reshape(B * Q, M * L * P),
            torch.arange(B).view(B, 1).expand(B, Q).reshape(B * Q), _finite_pixel(value))


def _finite_pixel(value):
    """The first of value's first _FINITE_SEARCH pixels with no inf or NaN in any batch or head (pixel 0 if none
    is): off-map taps read it with weight 0, and 0 * inf would be NaN."""
    finite = torch.isfinite(value[:, :_FINITE_SEARCH]).all(3).all(2).all(0).to(torch.uint8)
    return torch.cat((finite, finite.new_zeros(1))).argmax()


def forward(inputs):
    with _sized_threads(4 * inputs.attention_weights.numel()):  # B*Q*M*4*L*P taps
        return _forward(*inputs)


def _forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    dtype = grid_sample.compute_dtype(value, sampling_locations)
    table, locations, weights, batch, finite_pixel = _flat(value, sampling_locations, attention_weights, dtype,
                                                           value.dtype)
    out = []
    for start, end in _chunks(B * Q, M * 4 * L * P, _CHUNK_TAPS):
        taps = _Taps(value.shape, spatial_shapes, level_start_index, locations[start:end], batch[start:end], dtype,
                     finite_pixel)
        R = taps.rows.shape[0]
        a = weights[start:end].reshape(R, -1)
        sums = _bags(taps.rows.view(R, -1), table, taps.weights(a).view(R, -1))
        out.append(sums.add_(taps.nan.add(a - a).sum(1, keepdim=True)))  # a non-finite location or weight: NaN
    return torch.cat(out).view(B, Q, M * D)


def _bags(rows, table, weights):
    """(R, D): row r's sum of weights[r, t] * table[rows[r, t]], accumulated in fp32 by embedding_bag and rounded
    once to the table's dtype. A half table is summed in place, never converted (a copy of value would cost 40%
    of a decoder call): each weight is split into two half parts (``_split``) and each tap enters the bag twice,
    once with each, so the sum is still one sum."""
    if weights.dtype == table.dtype:
        return F.embedding_bag(rows, table, mode="sum", per_sample_weights=weights)
    return F.embedding_bag(torch.cat((rows, rows), 1), table, mode="sum",
                           per_sample_weights=_split(weights, table.dtype).flatten(1))


def _split(weights, dtype):
    """(R, 2, T) in the half ``dtype``, overwriting ``weights`` (R, T), fp32 or fp64: the parts (high, low) of each
    weight w, high + low = w. Both have w's sign and neither is 0 unless w is, so that a sampled +-inf pixel gives
    w * inf as in fp32, where a part of 0 or of the other sign gives NaN (0 * inf, inf - inf).

    high is w with the bits below the half's mantissa cleared, from a magnitude just below |w| (times 1 - 2^-22), so
    that the rest, low, is never 0; in fp16 also less 2^-23, so that low is never below fp16's least subnormal
    either. The sum of the parts is off by at most 2^-15 of w in bf16, 2^-21 of w plus 2^-24 (the spacing of fp16's
    subnormals) in fp16: twice the error of a rest from the nearest half, which may have the other sign, and far
    below the output's rounding. fp16 weights below 2^-23 have a high part of 0, and overflow past 65504.
    Plain passes over contiguous memory: comparisons, ``where``, mixed dtypes and broadcasts cost several times as
    much here."""
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[weights.dtype]
    dropped = round(math.log2(torch.finfo(dtype).eps / torch.finfo(weights.dtype).eps))  # mantissa bits
    below = 1 - 2.0 ** -22
    if dtype == torch.float16:
        high = weights.abs().mul_(below).sub_(2.0 ** -23).clamp_(min=0)
        high.view(bits).bitwise_and_(-1 << dropped)
        high.copysign_(weights)
    else:  # bf16's exponents are fp32's: no floor, and the sign bit stays as it is
        high = weights.mul(below)
        high.view(bits).bitwise_and_(-1 << dropped)
    low = weights.sub_(high)
    parts = high.new_empty((high.shape[0], 2, high.shape[1]), dtype=dtype)
    parts[:, 0], parts[:, 1] = high, low
    return parts


def backward(grad_output, inputs, grad_accum, deterministic):
    with _sized_threads(4 * inputs.attention_weights.numel()):
        return _backward(grad_output, *inputs)


def _backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    B, S, M, D = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    dtype = grid_sample.compute_dtype(value, sampling_locations)
    table, locations, weights, batch, finite_pixel = _flat(value, sampling_locations, attention_weights, dtype, dtype)
    g = grad_output.to(dtype).reshape(B * Q * M, D).contiguous()
    rows, off_taps, tap_weights, grad_locations, grad_weights = [], [], [], [], []
    for start, end in _chunks(B * Q, M * 4 * L * P, _CHUNK_TAPS):
        taps = _Taps(value.shape, spatial_shapes, level_start_index, locations[start:end], batch[start:end], dtype,
                     finite_pixel)
        a = weights[start:end]
        rows.append(taps.rows.view(-1))
        off_taps.append(taps.off_tap.view(-1))
        tap_weights.append(taps.weights(a).view(-1))
        grad_xy, grad_a = _location_and_weight_grads(taps, table, g[start * M:end * M])
        # a non-finite location: NaN weight and location gradients (every backend); its taps weigh 0
        grad_locations.append(grad_xy * a.reshape(-1, 1, L * P) * taps.size + taps.nan[:, None])
        grad_weights.append(grad_a + taps.nan)
    grad_locations = torch.cat(grad_locations).transpose(1, 2)
    grad_weights = torch.cat(grad_weights)
    grad_value = _transposed_sum(g, torch.cat(rows), torch.cat(off_taps), torch.cat(tap_weights), B * S * M,
                                 4 * L * P)
    return (grad_value.view(value.shape).to(value.dtype),
            grad_locations.reshape(sampling_locations.shape).to(sampling_locations.dtype).contiguous(),
            grad_weights.view(attention_weights.shape).to(attention_weights.dtype))


def _location_and_weight_grads(taps, table, g):
    """For each sample: (d out / d(x, y)) . g without the attention weight and level size, (C*M, 2, L*P), and
    d out / d(attention weight) . g, (C*M, L*P), from the dot products of its 4 corner rows with g."""
    R, _, LP = taps.rows.shape
    d00, d01, d10, d11 = _tap_dots(taps.rows.view(R, 4 * LP), table, g).view(R, 4, LP).unbind(1)
    (wx0, wy0), (wx1, wy1) = taps.axis[:, 0].unbind(1), taps.axis[:, 1].unbind(1)
    on_x0, on_y0, on_x1, on_y1 = (1 - taps.off_map.clamp(max=1)).view(R, 4, LP).unbind(1)
    column0, column1 = wy0 * d00 + wy1 * d10, wy0 * d01 + wy1 * d11  # interpolated along y
    row0, row1 = wx0 * d00 + wx1 * d01, wx0 * d10 + wx1 * d11  # along x
    grad_x = on_x1 * column1 - on_x0 * column0  # d(1 - frac)/dx = -1, d(frac)/dx = 1, on the map
    grad_y = on_y1 * row1 - on_y0 * row0
    return torch.stack((grad_x, grad_y), 1), wx0 * column0 + wx1 * column1


def _tap_dots(rows, table, g):
    """(R, T): the dot product of each tap's row of ``table`` with its output's row of ``g``."""
    R, T = rows.shape
    pieces = _chunks(R, T, _GATHER_TAPS)
    one_row_bags = torch.arange((pieces[0][1] - pieces[0][0]) * T, dtype=rows.dtype)  # embedding_bag as a gather
    dots = []
    for start, end in pieces:
        corner_rows = F.embedding_bag(rows[start:end].reshape(-1), table, one_row_bags[:(end - start) * T], mode="sum")
        dots.append(corner_rows.view(end - start, T, -1).mul_(g[start:end, None]).sum(-1))
    return torch.cat(dots)


def _transposed_sum(g, rows, off_taps, weights, num_rows, T):
    """grad_value as (num_rows, D): row j gets the sum of weight * g[r] over the taps (r, weight) reading j on
    the map, in tap order (a stable sort by row), as one embedding_bag over g's rows. Off-map taps go to a bag
    past the last row, which is dropped: a NaN in g or in a weight must not reach the row they read. Counts and
    offsets in int64 when there are 2^31 taps or more."""
    rows = rows + off_taps.clamp(max=1) * (num_rows - rows)  # off the map: row num_rows
    _, order = rows.sort(stable=True)
    count_dtype = _index_dtype(rows.numel())
    bag_of_tap = torch.div(order, T, rounding_mode="floor").to(count_dtype)
    counts = torch.zeros(num_rows + 1, dtype=count_dtype).index_add_(0, rows, torch.ones_like(rows, dtype=count_dtype))
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0, dtype=count_dtype)))
    return F.embedding_bag(bag_of_tap, g, offsets, per_sample_weights=weights.index_select(0, order), mode="sum",
                           include_last_offset=True)[:num_rows]


BACKEND = Backend(
    name="gather",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    auto_devices=frozenset({"cpu"}),
    reproducible_on=frozenset({"cpu"}),  # every sum in a fixed order (stable sort, sequential bags)
    priority=20,  # faster than grid_sample on the CPU: no re-layout of value
    traceable=True,  # torch operations only, no host reads: compile, export and AOTInductor see through it
)

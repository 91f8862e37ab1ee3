"""``python experiments/native_adds_emulated.py`` (from packages/msda-benchmarks) (CPU): how far grad_value would
err if some levels added natively.

For the decoder B4 Q300 (both location distributions), every in-map corner contribution a * w * g is computed in
float64 from the half-precision inputs; the exact sum is the reference. Native adds are emulated as the GPU does
them, each contribution rounded to the half dtype and each running sum rounded after every add, in query order;
the fp32 path as one rounding of the exact sum. A level adds natively where fewer than ``T`` corners per pixel
are expected there (4*Q*P / (H*W) <= T): T = inf is the all-native path, T = 0 the fp32 path. Printed: the
error over max|ref| and how many elements leave the fp32 path's entry in the tolerance table (BENCHMARKS.md,
"Accumulation paths").
"""

from dataclasses import replace

import msda_testkit as kit
import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def contributions(inputs):
    """(row of grad_value viewed as (B*S*M, D), contribution, level) of every in-map corner, in query order."""
    value, shapes = inputs["value"], inputs["spatial_shapes"].tolist()
    loc, a = inputs["sampling_locations"].double(), inputs["attention_weights"].double()
    g = kit.grad_output_for(inputs).double()  # (B, Q, M*D)
    B, S, M, D = value.shape
    Q = loc.shape[1]
    g = g.view(B, Q, M, 1, D)
    b = torch.arange(B).view(B, 1, 1, 1)
    m = torch.arange(M).view(1, 1, M, 1)
    rows, values, levels, start = [], [], [], 0
    for level, (H, W) in enumerate(shapes):
        x = loc[:, :, :, level, :, 0] * W - 0.5
        y = loc[:, :, :, level, :, 1] * H - 0.5
        x0, y0 = x.floor(), y.floor()
        fx, fy = x - x0, y - y0
        for dy, wy in ((0, 1 - fy), (1, fy)):
            for dx, wx in ((0, 1 - fx), (1, fx)):
                col, row = (x0 + dx).long(), (y0 + dy).long()
                inside = (col >= 0) & (col < W) & (row >= 0) & (row < H)
                pixel = start + row * W + col
                index = ((b * S + pixel) * M + m).expand_as(inside)
                coef = a[:, :, :, level] * wx * wy
                rows.append(index[inside])
                values.append((coef.unsqueeze(-1) * g)[inside])
                levels.append(torch.full((int(inside.sum()),), level))
        start += H * W
    rows = torch.cat(rows)
    order = torch.argsort(rows, stable=True)  # each element's contributions together, in the order made
    return rows[order], torch.cat(values)[order], torch.cat(levels)[order], (B * S * M, D)


def emulate(rows, values, native, dtype, shape):
    """grad_value with native adds for the entries marked ``native`` and one rounding of the exact sum for the
    others (each element's entries are all native or none: one level's pixels)."""
    exact = torch.zeros(shape, dtype=torch.float64).index_add_(0, rows, values)
    out = exact.to(dtype).double()
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    starts = torch.nonzero(first).squeeze(1)
    rank = torch.arange(rows.numel()) - starts[torch.cumsum(first.long(), 0) - 1]
    acc = torch.zeros(shape, dtype=torch.float64)
    for k in range(int(rank.max()) + 1 if rows.numel() else 0):
        pick = (rank == k) & native
        r = rows[pick]
        acc[r] = (acc[r] + values[pick].to(dtype).double()).to(dtype).double()
    touched = torch.zeros(shape[0], dtype=torch.bool)
    touched[rows[native]] = True
    out[touched] = acc[touched]
    return out, exact


def main():
    case = kit.case("decoder_b4_q300")
    table = []
    for layout in ("random", "model_like"):
        for name, dtype in DTYPES.items():
            inputs = kit.make_inputs(replace(case, loc_range=(-0.1, 1.1), layout=layout), dtype)
            rows, values, levels, shape = contributions(inputs)
            Q, P = inputs["sampling_locations"].shape[1], inputs["sampling_locations"].shape[4]
            per_pixel = torch.tensor([4 * Q * P / (h * w) for h, w in inputs["spatial_shapes"].tolist()])
            tol = kit.tolerance(dtype, "gradient")
            for T in (0.0, 1.0, 2.0, float("inf")):
                native = per_pixel[levels] <= T
                got, exact = emulate(rows, values, native, dtype, shape)
                scale = exact.abs().max()
                err = (got - exact).abs()
                outside = int((err > tol.atol * scale + tol.rtol * exact.abs()).sum())
                table.append((layout, name, T, f"{float(err.max() / scale):.2e}", outside))
                print(*table[-1], flush=True)
    print("layout dtype T(native where <= T corners per pixel) error/scale elements_outside_the_fp32_entry")


if __name__ == "__main__":
    main()

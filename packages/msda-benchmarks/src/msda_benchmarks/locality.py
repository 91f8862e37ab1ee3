"""``python -m msda_benchmarks.locality``: how far merging on chip could cut the backward's atomic traffic (CPU).

The backward adds one contribution to grad_value per in-map corner of every sample, each an atomic add of D
channels into the L2. A kernel whose program holds R consecutive queries of one head could first merge the
contributions of its block that land on the same pixel. For each location distribution and R this prints the
corner contributions over the distinct (block, pixel) destinations: the factor by which such merging could
at most divide that traffic (R = 1: merging within one query's samples).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from msda_testkit import cli
from msda_testkit.cases import make_inputs
from tabulate import tabulate

from .bench import GPU_CASES, LAYOUTS

BLOCKS = (1, 16, 32, 64)


def merge_factor(inputs: dict, block_queries: int) -> float:
    """In-map corner contributions over distinct destinations, blocks of ``block_queries`` queries of one head."""
    loc = inputs["sampling_locations"].double()
    B, Q, M, L, P, _ = loc.shape
    S = inputs["value"].shape[1]
    H, W = (inputs["spatial_shapes"][:, i].view(1, 1, 1, L, 1) for i in (0, 1))
    start = inputs["level_start_index"].view(1, 1, 1, L, 1)
    x0 = torch.floor(loc[..., 0] * W - 0.5).long()  # align_corners=False, as the kernels
    y0 = torch.floor(loc[..., 1] * H - 0.5).long()
    q = torch.arange(Q).view(1, Q, 1, 1, 1)
    block = (torch.arange(B).view(B, 1, 1, 1, 1) * M + torch.arange(M).view(1, 1, M, 1, 1)) * Q + q // block_queries
    destinations = []
    for dy in (0, 1):
        for dx in (0, 1):
            x, y = x0 + dx, y0 + dy
            in_map = (x >= 0) & (x < W) & (y >= 0) & (y < H)
            destinations.append((block * S + start + y * W + x)[in_map])
    destinations = torch.cat(destinations)
    return destinations.numel() / destinations.unique().numel()


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.locality", __doc__)
    parser.add_argument("--batch", type=int, default=1, help="the bench's encoder shape (Q = S = 22223) at this batch")
    parser.add_argument("--blocks", type=int, nargs="*", default=list(BLOCKS), help="queries per block, R")
    parser.add_argument("--json", default="locality.json", help="where the results go, in the current folder")
    args = parser.parse_args(argv)
    encoder = GPU_CASES[1]
    rows = []
    for layout in LAYOUTS:
        inputs = make_inputs(replace(encoder, batch=args.batch, layout=layout))
        rows += [{"batch": args.batch, "locations": layout, "block_queries": r,
                  "merge_factor": merge_factor(inputs, r)} for r in args.blocks]
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".3f"))
    cli.write_results(args.json, {"torch": torch.__version__}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m msda_benchmarks.tune``: time the Triton kernels over block shapes and warps on one case (GPU).

A measuring tool for choosing msda_triton.kernels.launch_config: each configuration is timed by replaying a CUDA
graph of the bare kernel launch (no host overhead), median of triton.testing's runs. Triton and msda-triton are
imported only to run (``pip install 'msda-benchmarks[triton]'``), so --help works without them.
"""

from __future__ import annotations

import dataclasses
import itertools

import msda_core
import msda_testkit as kit
import torch
from msda_testkit import cli
from tabulate import tabulate

from .bench import environment

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.tune", __doc__)
    parser.add_argument("--case", default="encoder_b2", help="the inputs, a msda_testkit case")
    parser.add_argument("--batch", type=int, help="the case with this batch size instead")
    parser.add_argument("--queries", type=int, help="the case with this many queries instead")
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=list(DTYPES), help="value dtypes")
    parser.add_argument("--block-r", nargs="*", type=int, default=[16, 32, 64, 128],
                        help="rows (query, head pairs) per program")
    parser.add_argument("--block-p", nargs="*", type=int, default=[1],
                        help="points of each row per step, of one level (the forward's only)")
    parser.add_argument("--warps", nargs="*", type=int, default=[1, 2, 4, 8], help="warps per program")
    parser.add_argument("--orders", nargs="*", default=["row", "head"], choices=["row", "head"],
                        help="row-major or head-major blocks of rows (kernels._block_rows; the forward's only)")
    parser.add_argument("--json", default="tune.json", help="where the results go")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog}: times Triton kernels on a CUDA GPU; torch sees none here")
    import triton.testing
    from msda_triton.backend import launch_backward, launch_forward
    from msda_triton.kernels import launch_config

    case = kit.case(args.case)
    case = dataclasses.replace(case, batch=args.batch or case.batch, queries=args.queries or case.queries)
    rows = []
    for dtype_name in args.dtypes:
        inputs = kit.make_inputs(case, DTYPES[dtype_name], device="cuda")
        value, shapes, starts, loc, weights = (inputs[k] for k in kit.ARGUMENTS)
        D = value.shape[3]
        out = value.new_empty(msda_core.output_shape(value, loc))
        grad_output = kit.grad_output_for(inputs)
        grads = (torch.zeros(value.shape, dtype=torch.float32, device="cuda"), torch.empty_like(loc),
                 torch.empty_like(weights))
        block_d = launch_config(D, backward=True)[0]["BLOCK_D"]
        for block_r, block_p, warps, order in itertools.product(args.block_r, args.block_p, args.warps, args.orders):
            fwd = triton.testing.do_bench_cudagraph(lambda: launch_forward(value, shapes, starts, loc, weights, out, (
                {"BLOCK_R": block_r, "BLOCK_P": block_p, "BLOCK_D": block_d, "HEAD_MAJOR": order == "head"}, warps)))
            bwd = None if order == "head" or block_p > 1 else triton.testing.do_bench_cudagraph(
                lambda: launch_backward(grad_output, value, shapes, starts, loc, weights, *grads,
                                        config=({"BLOCK_R": block_r, "BLOCK_D": block_d}, warps)))  # row-major only
            rows.append([f"{case.name} B{case.batch} Q{case.queries}", dtype_name, order, block_r, block_p, block_d,
                         warps, fwd, bwd])
            print(rows[-1], flush=True)
    headers = ["case", "dtype", "order", "BLOCK_R", "BLOCK_P", "BLOCK_D", "warps", "fwd ms", "bwd ms (fp32 acc)"]
    print(tabulate(rows, floatfmt=".4g", headers=headers))
    cli.write_results(args.json, environment(torch.device("cuda")), [dict(zip(headers, row)) for row in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

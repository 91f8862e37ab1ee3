"""``python -m msda_benchmarks.deploy_bench``: the op's time eagerly, under torch.compile (default and
reduce-overhead) and as an AOTInductor package run from msda_testkit's C++ runner.

The runner and the packages are built in a temporary folder, removed at the end.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from msda_testkit import cli
from msda_testkit.cases import ARGUMENTS, DIFFERENTIABLE, case, grad_output_for, make_inputs
from msda_testkit.deploy import build_aoti_runner, run_aoti_package
from tabulate import tabulate

from .bench import environment
from .timing import host_ms


class _Op(torch.nn.Module):
    """The op alone, as a module: what torch.export packages."""

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights)


def measure(name: str, dtype: torch.dtype, device: torch.device, folder: Path, runner: Path, args) -> dict:
    """One case's row: each mode's forward and forward+backward, and the AOTI package's forward from C++."""
    inputs = make_inputs(case(name), dtype, device=device)
    call = [inputs[k] for k in ARGUMENTS]
    grad_output = grad_output_for(inputs)
    leaves = [inputs[k].detach().requires_grad_() for k in DIFFERENTIABLE]
    with_leaves = [leaves[0], call[1], call[2], leaves[1], leaves[2]]
    op = _Op()
    row = {"case": name, "dtype": args.dtype}
    for mode, fn in (("eager", op), ("compiled", torch.compile(op, fullgraph=True)),
                     ("reduce-overhead", torch.compile(op, mode="reduce-overhead", fullgraph=True))):
        with torch.no_grad():
            row[f"{mode} fwd"] = statistics.median(host_ms(lambda: fn(*call), args.seconds))
        row[f"{mode} fwd+bwd"] = statistics.median(host_ms(
            lambda: torch.autograd.grad(fn(*with_leaves), leaves, grad_output), args.seconds))
    with torch.no_grad():
        program = torch.export.export(op, tuple(call))
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"{name}.pt2"))
    _, row["AOTI (C++) fwd"] = run_aoti_package(runner, package, call, device.type, args.repeats)
    return row


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.deploy_bench", __doc__)
    cli.add_device(parser)
    parser.add_argument("--cases", nargs="*", default=["decoder_b4_q300", "encoder_b2"], help="msda_testkit cases")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the inputs' dtype")
    parser.add_argument("--seconds", type=float, default=0.5, help="the least time of timed calls per Python figure")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls of the C++ runner")
    parser.add_argument("--json", default="deploy_bench.json",
                        help="where the figures go, in the current folder by default")
    args = parser.parse_args(argv)
    device = cli.device(parser.prog, args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="msda-deploy-") as folder:  # the runner and the packages: removed
        runner = build_aoti_runner(folder)
        for name in args.cases:
            rows.append(measure(name, getattr(torch, args.dtype), device, Path(folder), runner, args))
            print(rows[-1], flush=True)
    env = environment(device)
    print(env)
    print(tabulate([r.values() for r in rows], headers=list(rows[0]), floatfmt=".4f"))
    cli.write_results(args.json, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

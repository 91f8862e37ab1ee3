"""``python -m msda_benchmarks.peers``: msda's op against other implementations installed beside it (GPU).

The bench's inputs (GPU_CASES, in each location distribution) and timing: called from Python, the median of
triton's do_bench, and replayed from a CUDA graph (None where a call cannot be captured); backward =
forward+backward minus forward through torch.autograd.grad. The implementations take turns for ``--rounds``
rounds and each figure is the median over them, so that the host's speed, which drifts within a lease,
weighs on all alike. Each row also gives the forward's error against float64 (``grid_sample`` on the inputs
upcast), over the largest |result|: a peer is a fair comparison only where that error is the dtype's rounding.

Peers, each where it imports: deformops (its default selection, and its CUDA backend), Deformable DETR's
CUDA extension (the module ``MultiScaleDeformableAttention`` its ``models/ops`` builds; fp32 and fp64 only),
called through an autograd Function of ours, and the Triton port roulbac/msda-triton (its package
``msda_triton`` shares our package's name, so it is imported as ``msda_triton_port``; fp32, fp16 and bf16).
A peer that refuses a dtype is left out of that dtype's rows. The JSON's environment records where each
peer that ran came from.
"""

from __future__ import annotations

import json
import statistics
from importlib.metadata import PackageNotFoundError, version

import torch
from msda_testkit import cli
from msda_testkit.cases import ARGUMENTS, grad_output_for, make_inputs
from tabulate import tabulate

from .bench import (
    DTYPES,
    GPU_CASES,
    LAYOUTS,
    backward_ms,
    environment,
    training_leaves,
    with_backward,
    with_layout,
)
from .timing import graph_ms, median_ms

EXTENSION_IM2COL_STEP = 64  # what Deformable DETR's module passes


def _deformops(backend: str | None = None):
    from deformops.registry import Backend, msda
    chosen = None if backend is None else Backend(backend)  # its own enum: it refuses a plain string
    return lambda *args: msda(*args, backend=chosen)


def _extension():
    import MultiScaleDeformableAttention as ext  # the name Deformable DETR's setup.py builds

    class Extension(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value, shapes, starts, locations, weights):
            ctx.save_for_backward(value, shapes, starts, locations, weights)
            return ext.ms_deform_attn_forward(value, shapes, starts, locations, weights, EXTENSION_IM2COL_STEP)

        @staticmethod
        def backward(ctx, grad_output):
            value, shapes, starts, locations, weights = ctx.saved_tensors
            grads = ext.ms_deform_attn_backward(value, shapes, starts, locations, weights,
                                                grad_output.contiguous(), EXTENSION_IM2COL_STEP)
            return grads[0], None, None, grads[1], grads[2]

    return lambda value, shapes, starts, locations, weights: Extension.apply(value, shapes.long(), starts.long(),
                                                                             locations, weights)


def _triton_port():
    # the op's five tensors in our order and layout: value (B, S, M, D), locations (B, Q, M, L, P, 2)
    from msda_triton_port import multi_scale_deformable_attention
    return multi_scale_deformable_attention


# name -> (its origin: a distribution, whose version is recorded, or where the source built came from,
#          recorded as it is; a loader returning a callable of the op's five tensors)
PEERS = {"deformops": ("deformops", _deformops),
         "deformops CUDA": ("deformops", lambda: _deformops(backend="cuda")),
         "CUDA ext": ("fundamentalvision/Deformable-DETR models/ops at 11169a60c33333af00a4849f1808023eba96a931, "
                      "patched to build on current torch", _extension),
         "Triton port": ("roulbac/msda-triton src/msda_triton at 7fd08865816bbdcc861b995d121e58dc28409e9a",
                         _triton_port)}


def installed_peers() -> dict:
    """name -> a callable of the op's five tensors, for each peer of PEERS that imports."""
    found = {}
    for name, (_, load) in PEERS.items():
        try:
            found[name] = load()
        except ImportError:
            print(f"{name} is not installed: skipped")
    return found


def _relative_error(result, reference) -> float:
    return ((result.double() - reference).abs().max() / reference.abs().max()).item()


def _origin(origin: str) -> str:
    try:
        return version(origin)
    except PackageNotFoundError:
        return origin


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.peers", __doc__)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES), help="value dtypes")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="location distributions, as the bench's")
    parser.add_argument("--cases", nargs="*", default=[c.name for c in GPU_CASES],
                        choices=[c.name for c in GPU_CASES], help="the bench's cases to run (a lease too short for all "
                        "can run them in parts)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns each implementation takes; each figure is their median")
    parser.add_argument("--json", default="peers.json", help="where the results and the environment are written "
                        "(a relative path is in the current folder)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the peers run on a CUDA GPU; none is available")
        return 2
    peers = installed_peers()
    if not peers:
        print("no peer is installed: " + ", ".join(PEERS))
        return 2
    device = torch.device("cuda")
    rows = []
    cases = [c for c in GPU_CASES if c.name in args.cases]
    for case in (with_layout(c, layout) for c in cases for layout in args.layouts):
        for dtype_name in args.dtypes:
            inputs = make_inputs(case, DTYPES[dtype_name], device=device)
            reference = torch.ops.msda.deform_attn(**{k: (v.double() if v.is_floating_point() else v)
                                                       for k, v in inputs.items()}, backend="grid_sample")
            leaves = training_leaves(inputs)
            grad_output = grad_output_for(inputs)
            calls = {"msda (triton)": lambda: torch.ops.msda.deform_attn(**leaves, backend="triton")}
            # the outputs compared below, from the calls that are timed; detached, so no autograd graph outlives them
            results = {"msda (triton)": calls["msda (triton)"]().detach().float()}
            for name, fn in peers.items():
                def call(fn=fn):
                    return fn(*(leaves[k] for k in ARGUMENTS)).reshape(grad_output.shape)

                try:
                    results[name] = call().detach().float()
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
                    print(f"{name} refuses {case.name} {dtype_name}: {str(err).splitlines()[0]}")
                    continue
                calls[name] = call
            both_calls = {name: with_backward(fn, leaves, grad_output) for name, fn in calls.items()}
            times = {name: {"fwd": [], "both": [], "fwd_graph": [], "both_graph": []} for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    both = both_calls[name]
                    for key, ms in (("fwd", median_ms(fn, device)), ("both", median_ms(both, device)),
                                    ("fwd_graph", graph_ms(fn)), ("both_graph", graph_ms(both))):
                        times[name][key].append(ms)
            for name in calls:
                t = {key: statistics.median(v) if None not in v else None for key, v in times[name].items()}
                rows.append({"case": case.name, "locations": case.layout, "dtype": dtype_name, "implementation": name,
                             "fwd_ms": t["fwd"], "bwd_ms": t["both"] - t["fwd"], "fwd_graph_ms": t["fwd_graph"],
                             "bwd_graph_ms": backward_ms(t["both_graph"], t["fwd_graph"]),
                             "fwd_error_vs_fp64": _relative_error(results[name], reference),
                             "max_abs_diff_from_msda": (results[name] - results["msda (triton)"]).abs().max().item()})
                print(rows[-1], flush=True)
    env = environment(device)
    env.update({name: _origin(PEERS[name][0]) for name in peers if any(r["implementation"] == name for r in rows)})
    print(json.dumps(env))
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".4g"))
    cli.write_results(args.json, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

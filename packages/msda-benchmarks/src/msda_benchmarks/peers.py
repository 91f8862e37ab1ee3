"""``python -m msda_benchmarks.peers``: msda's op against other implementations installed beside it (GPU).

The bench's inputs (GPU_CASES, in each location distribution) and timing: called from Python, the median of
triton's do_bench, and replayed from a CUDA graph (None where a call cannot be captured); backward =
forward+backward minus forward through torch.autograd.grad. The implementations take turns for ``--rounds``
rounds and each figure is the median over them, so that the host's speed, which drifts within a lease,
weighs on all alike. Peers: deformops (its default selection, ``deformops.registry.msda``), when installed.
"""

from __future__ import annotations

import importlib
import json
import statistics

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

PEERS = {"deformops": ("deformops.registry", "msda")}  # name -> (module, callable with the op's five tensors)


def _installed_peers() -> dict:
    found = {}
    for name, (module, attribute) in PEERS.items():
        try:
            found[name] = getattr(importlib.import_module(module), attribute)
        except ImportError:
            print(f"{name} is not installed: skipped")
    return found


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.peers", __doc__)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES), help="value dtypes")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="location distributions, as the bench's")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns each implementation takes; each figure is their median")
    parser.add_argument("--json", default="peers.json", help="where the results and the environment are written "
                        "(a relative path is in the current folder)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the peers run on a CUDA GPU; none is available")
        return 2
    peers = _installed_peers()
    if not peers:
        print("no peer is installed: " + ", ".join(PEERS))
        return 2
    device = torch.device("cuda")
    rows = []
    for case in (with_layout(c, layout) for c in GPU_CASES for layout in args.layouts):
        for dtype_name in args.dtypes:
            inputs = make_inputs(case, DTYPES[dtype_name], device=device)
            leaves = training_leaves(inputs)
            grad_output = grad_output_for(inputs)
            calls = {"msda (triton)": lambda: torch.ops.msda.deform_attn(**leaves, backend="triton")}
            calls |= {name: (lambda fn=fn: fn(*(leaves[k] for k in ARGUMENTS)).reshape(grad_output.shape))
                      for name, fn in peers.items()}
            ours = calls["msda (triton)"]().float()
            both_calls = {name: with_backward(fn, leaves, grad_output) for name, fn in calls.items()}
            times = {name: {"fwd": [], "both": [], "fwd_graph": [], "both_graph": []} for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    both = both_calls[name]
                    for key, ms in (("fwd", median_ms(fn, device)), ("both", median_ms(both, device)),
                                    ("fwd_graph", graph_ms(fn)), ("both_graph", graph_ms(both))):
                        times[name][key].append(ms)
            for name, fn in calls.items():
                t = {key: statistics.median(v) if None not in v else None for key, v in times[name].items()}
                rows.append({"case": case.name, "locations": case.layout, "dtype": dtype_name, "implementation": name,
                             "fwd_ms": t["fwd"], "bwd_ms": t["both"] - t["fwd"], "fwd_graph_ms": t["fwd_graph"],
                             "bwd_graph_ms": backward_ms(t["both_graph"], t["fwd_graph"]),
                             "max_abs_diff_from_msda": (fn().float() - ours).abs().max().item()})
                print(rows[-1], flush=True)
    env = environment(device)
    env.update({name: importlib.import_module(PEERS[name][0].split(".")[0]).__version__ for name in peers})
    print(json.dumps(env))
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".4g"))
    cli.write_results(args.json, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python experiments/tensor_descriptors.py`` (from packages/msda-benchmarks) (GPU): the kernels' DESCRIPTORS
form against the plain one, through the production launchers.

DESCRIPTORS moves the forward's output tile and the backward's grad_output tiles through tensor descriptors
(``tl.make_tensor_descriptor``: the TMA on sm_90). For each standard case (model-like and uniform locations) and
dtype: the forward (both launch rules' configs as launch_config gives them) and the backward with fp32
accumulation, each replayed from a CUDA graph, the two forms taking turns for ``--rounds`` rounds; medians, ms.
Prints a table and writes JSON.
"""

import argparse
import statistics

import torch
from msda_benchmarks.bench import DTYPES, GPU_CASES, LAYOUTS, environment, with_layout
from msda_benchmarks.timing import graph_ms
from msda_testkit import cli
from msda_testkit.cases import ARGUMENTS, grad_output_for, make_inputs
from msda_triton import kernels
from msda_triton.backend import descriptors_fit, launch_backward, launch_forward
from tabulate import tabulate


def calls(inputs, descriptors: bool) -> dict:
    """name -> a call launching one kernel of the given form."""
    value, shapes, starts, loc, weights = (inputs[k].contiguous() for k in ARGUMENTS)
    D = value.shape[3]
    n_rows = value.shape[0] * loc.shape[1] * value.shape[2]
    out = value.new_empty(value.shape[0], loc.shape[1], value.shape[2] * D)
    blocks, warps = kernels.launch_config(D, backward=False, few_rows=n_rows < kernels.FEW_ROWS,
                                          value_fp32=value.dtype == torch.float32)
    forward = ({**blocks, "WIDE": False, "DESCRIPTORS": descriptors}, warps)
    grad_output = grad_output_for(inputs).contiguous()
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    grads = (grad_value, torch.empty_like(loc), torch.empty_like(weights))
    blocks, warps = kernels.launch_config(D, backward=True)
    backward = ({**blocks, "DESCRIPTORS": descriptors}, warps)
    assert descriptors_fit(D, out, grad_output)
    return {"forward": lambda: launch_forward(value, shapes, starts, loc, weights, out, forward),
            "backward fp32 acc": lambda: (grad_value.zero_(),
                                          launch_backward(grad_output, value, shapes, starts, loc, weights, *grads,
                                                          config=backward))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="tensor-descriptors.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for case in (with_layout(c, layout) for c in GPU_CASES for layout in LAYOUTS):
        for dtype_name, dtype in DTYPES.items():
            inputs = make_inputs(case, dtype, device=device)
            forms = {"plain": calls(inputs, False), "descriptors": calls(inputs, True)}
            times = {(form, kernel): [] for form in forms for kernel in forms[form]}
            for _ in range(args.rounds):
                for form, kernels_of_form in forms.items():
                    for kernel, fn in kernels_of_form.items():
                        times[form, kernel].append(graph_ms(fn))
            for kernel in forms["plain"]:
                plain, described = (statistics.median(times[form, kernel]) for form in forms)
                rows.append({"case": case.name, "locations": case.layout, "dtype": dtype_name, "kernel": kernel,
                             "plain_ms": plain, "descriptors_ms": described, "ratio": described / plain})
                print(rows[-1], flush=True)
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".4g"))
    cli.write_results(args.json, environment(device), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

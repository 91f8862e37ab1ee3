"""``python experiments/decoder_backward_split.py [out.json]`` (from packages/msda-benchmarks) (GPU, deformops
installed): where the decoder B4 Q300 backward's time goes, kernel by kernel, msda's Triton op beside deformops.

Per location distribution and dtype (fp32, bf16): CUDA-graph replays of zeroing a buffer of value's shape (fp32,
and value's dtype) and of each implementation's forward and forward+backward; then torch.profiler's GPU time per
kernel name over 20 forward+backward calls (BENCHMARKS.md, "What bounds each cell": the decoder backward's floor).
"""
import collections
import json
import sys

import torch
from msda_benchmarks.bench import GPU_CASES, environment, training_leaves, with_backward, with_layout
from msda_benchmarks.peers import PEERS
from msda_benchmarks.timing import graph_ms
from msda_testkit.cases import ARGUMENTS, grad_output_for, make_inputs
from torch.profiler import ProfilerActivity, profile

CALLS = 20


def kernel_ms(fn) -> dict:
    """GPU ms per call of each kernel name (the first 90 characters) over CALLS calls, after 5 untimed."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name[:90]] += event.device_time / CALLS / 1000
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(path: str) -> None:
    deformops = PEERS["deformops"][1]()  # the peers tool's call of deformops' default
    out = {}
    for layout in ("model_like", "random"):
        case = with_layout(GPU_CASES[0], layout)
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_inputs(case, dtype, device=torch.device("cuda"))
            leaves = training_leaves(inputs)
            grad_output = grad_output_for(inputs)
            value = leaves["value"]
            calls = {"msda": lambda: torch.ops.msda.deform_attn(**leaves, backend="triton"),
                     "deformops": lambda: deformops(*(leaves[k] for k in ARGUMENTS)).reshape(grad_output.shape)}
            out[f"{layout} {dtype} zero fp32 buffer of value"] = graph_ms(
                lambda: torch.zeros(value.shape, dtype=torch.float32, device=value.device))
            out[f"{layout} {dtype} zero buffer of value's dtype"] = graph_ms(lambda: torch.zeros_like(value))
            for name, fn in calls.items():
                both = with_backward(fn, leaves, grad_output)
                out[f"{layout} {dtype} {name} fwd+bwd graph"] = graph_ms(both)
                out[f"{layout} {dtype} {name} fwd graph"] = graph_ms(fn)
                out[f"{layout} {dtype} {name} kernels ms"] = kernel_ms(both)
    result = {"environment": environment(torch.device("cuda")), "results": out}
    print(json.dumps(result, indent=1))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decoder-backward-split.json")

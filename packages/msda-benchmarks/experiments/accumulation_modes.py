"""``python experiments/accumulation_modes.py OUT.json [--accuracy] [--sweep] [--profile]`` (GPU; from
packages/msda-benchmarks): the backward of every accumulation mode of the Triton backend (auto, native, fp32,
deterministic), graph replay (backward = forward+backward less forward), decoder B4 Q300 and encoder B2 in both
location distributions, fp32/fp16/bf16. Only the public op is called, so the same script times an older tree (run
it with that tree's packages first on PYTHONPATH) beside the current one.

``--accuracy``: grad_value's norm-wise error against float64 (grid_sample on the inputs upcast) of native adds and
of fp32 accumulation, at 4*Q*L*P/S from 0.2 to 64 expected terms per element (the DETR levels, batch 1, Q varied),
and of the deterministic mode (BENCHMARKS.md, "Accumulation paths"). ``--sweep``: the half native-add backward
kernel alone on the decoder over block rows and warps (the launch rule's choice). ``--profile``: each kernel's
GPU time in one backward of the default and the deterministic mode (torch.profiler), decoder and encoder, fp32
and bf16: where the deterministic mode's time goes.
"""
import json
import os
import sys
from dataclasses import replace

import msda_testkit as kit
import torch
from msda_benchmarks.bench import GPU_CASES, LAYOUTS, training_leaves, with_backward, with_layout
from msda_benchmarks.timing import graph_ms

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MODES = {"auto": {}, "native": {"grad_accum": "native"}, "fp32": {"grad_accum": "fp32"},
         "deterministic": {"deterministic": True}}


def timings(rows):
    for case in (with_layout(c, layout) for c in GPU_CASES[:2] for layout in LAYOUTS):
        for dtype_name, dtype in DTYPES.items():
            inputs = kit.make_inputs(case, dtype, device="cuda")
            leaves = training_leaves(inputs)
            grad_output = kit.grad_output_for(inputs)
            for mode, kwargs in MODES.items():
                if dtype_name == "fp32" and mode in ("native", "fp32"):
                    continue  # fp32 gradients add in fp32 whatever grad_accum says

                def forward(kwargs=kwargs):
                    return torch.ops.msda.deform_attn(**leaves, backend="triton", **kwargs)
                fwd, both = graph_ms(forward), graph_ms(with_backward(forward, leaves, grad_output))
                rows.append({"case": case.name, "locations": case.layout, "dtype": dtype_name, "mode": mode,
                             "fwd_graph_ms": fwd, "bwd_graph_ms": both - fwd})
                print(rows[-1], flush=True)


def norm_error(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def accuracy(rows):
    base = replace(GPU_CASES[1], batch=1)
    S = base.spatial_size
    for queries in (300, S) if os.environ.get("ACC_QUERIES") == "short" else (150, 300, 600, 1200, S):
        for layout in LAYOUTS:
            case = replace(base, name=f"q{queries}", queries=queries, layout=layout)
            for dtype_name in ("fp16", "bf16", "fp32"):
                inputs = kit.make_inputs(case, DTYPES[dtype_name], device="cuda")
                g = kit.grad_output_for(inputs)
                ref = kit.run(kit.upcast(inputs, torch.float64), "grid_sample", g.double())["grad_value"]
                errs = {mode: norm_error(kit.run(inputs, "triton", g, **MODES[mode])["grad_value"], ref)
                        for mode in (("native", "fp32", "deterministic") if dtype_name != "fp32"
                                     else ("auto", "deterministic"))}
                rows.append({"queries": queries, "terms_per_element": 4 * queries * 16 / S, "locations": layout,
                             "dtype": dtype_name, **{f"norm_err_{m}": e for m, e in errs.items()}})
                print(rows[-1], flush=True)


def sweep(rows):
    from msda_triton.backend import launch_backward
    for dtype_name in ("fp16", "bf16"):
        inputs = kit.make_inputs(with_layout(GPU_CASES[0], "model_like"), DTYPES[dtype_name], device="cuda")
        value, shapes, starts, loc, weights = (inputs[k] for k in kit.ARGUMENTS)
        g = kit.grad_output_for(inputs)
        grads = (torch.zeros_like(value), torch.empty_like(loc), torch.empty_like(weights))
        for block_r in (4, 8, 16, 32, 64):
            for warps in (1, 2, 4):
                import triton.testing
                ms = triton.testing.do_bench_cudagraph(lambda: launch_backward(
                    g, value, shapes, starts, loc, weights, *grads, config=({"BLOCK_R": block_r, "BLOCK_D": 32},
                                                                            warps)))
                rows.append({"dtype": dtype_name, "BLOCK_R": block_r, "warps": warps, "kernel_ms": ms})
                print(rows[-1], flush=True)


def profile(rows):
    for case in (with_layout(c, "random") for c in GPU_CASES[:2]):
        for dtype_name in ("fp32", "bf16"):
            inputs = kit.make_inputs(case, DTYPES[dtype_name], device="cuda")
            leaves = training_leaves(inputs)
            grad_output = kit.grad_output_for(inputs)
            for mode in ("auto", "deterministic"):
                out = torch.ops.msda.deform_attn(**leaves, backend="triton", deterministic=mode == "deterministic")

                def backward(out=out):
                    torch.autograd.grad(out, [leaves[k] for k in kit.DIFFERENTIABLE], grad_output, retain_graph=True)
                for _ in range(3):
                    backward()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        backward()
                    torch.cuda.synchronize()
                kernels = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total}
                rows.append({"case": case.name, "dtype": dtype_name, "mode": mode, "kernel_us": kernels,
                             "total_us": sum(kernels.values())})
                print(rows[-1], flush=True)


def main(path):
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, run in (("timings", timings), ("accuracy", accuracy), ("sweep", sweep), ("profile", profile)):
        if name == "timings" or f"--{name}" in sys.argv:
            results[name] = []
            run(results[name])
            with open(path, "w") as f:  # after each part: a part cut short by a time limit loses only itself
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

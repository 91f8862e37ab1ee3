"""``python experiments/fp8_forward.py OUT.json`` (from packages/msda-benchmarks) (GPU, sm_89+): would an fp8
value make the inference forward faster? (issue 39, item 4)

value quantized to float8_e4m3fn with one scale per (head, channel), amax / 448 over batch and pixels: a
per-(m, d) scale factors out of the sum over samples, so the forward is the unchanged forward_kernel reading fp8
(its loads convert to fp32) into a bf16 output, times the scales. Timed by CUDA-graph replay against the bf16
forward of the same inputs, kernel alone (launch configs from the many-rows rule and wider tiles, since an fp8
row of 32 channels is only 32 bytes) and with the scale multiply; the error of both against float64 (grid_sample
on the unquantized inputs upcast), over max |result| and norm-wise.
"""
import json
import sys

import msda_core
import msda_testkit as kit
import torch
import triton.testing
from msda_benchmarks.bench import GPU_CASES, LAYOUTS, with_layout
from msda_triton.backend import launch_forward
from msda_triton.kernels import launch_config

E4M3_MAX = 448.0
CONFIGS = [None] + [({"BLOCK_R": r, "BLOCK_P": 1, "BLOCK_D": 32, "HEAD_MAJOR": True}, w)
                    for r, w in ((64, 4), (64, 8), (128, 8), (32, 2))]


def quantize(value):
    scale = value.float().abs().amax(dim=(0, 1)).clamp_min(1e-12) / E4M3_MAX  # (M, D)
    return (value.float() / scale).to(torch.float8_e4m3fn), scale


def errors(got, ref):
    got = got.double()
    return {"max_over_scale": ((got - ref).abs().max() / ref.abs().max()).item(),
            "norm_wise": ((got - ref).norm() / ref.norm()).item()}


def main(path):
    rows = []
    for case in (with_layout(c, layout) for c in GPU_CASES[1:] for layout in LAYOUTS):
        inputs = kit.make_inputs(case, torch.bfloat16, device="cuda")
        value, shapes, starts, loc, weights = (inputs[k] for k in kit.ARGUMENTS)
        ref = kit.run(kit.upcast(inputs, torch.float64), "grid_sample")["output"]
        out = value.new_empty(msda_core.output_shape(value, loc))
        value8, scale = quantize(value)
        flat_scale = scale.reshape(-1).to(torch.bfloat16)
        for config in CONFIGS:
            name = "rule" if config is None else f"{config[0]['BLOCK_R']}x{config[1]}w"
            bf16 = triton.testing.do_bench_cudagraph(
                lambda: launch_forward(value, shapes, starts, loc, weights, out, config))
            fp8 = triton.testing.do_bench_cudagraph(
                lambda: launch_forward(value8, shapes, starts, loc, weights, out, config))

            def scaled(config=config):
                launch_forward(value8, shapes, starts, loc, weights, out, config)
                out.mul_(flat_scale)
            both = triton.testing.do_bench_cudagraph(scaled)
            rows.append({"case": case.name, "locations": case.layout, "config": name,
                         "bf16_ms": bf16, "fp8_kernel_ms": fp8, "fp8_with_scale_ms": both,
                         "speedup_kernel": bf16 / fp8, "speedup_with_scale": bf16 / both})
            print(rows[-1], flush=True)
        launch_forward(value, shapes, starts, loc, weights, out)
        err_bf16 = errors(out, ref)
        launch_forward(value8, shapes, starts, loc, weights, out)
        out.mul_(flat_scale)
        rows.append({"case": case.name, "locations": case.layout, "error_bf16": err_bf16,
                     "error_fp8": errors(out, ref), "rule": launch_config(32, backward=False)})
        print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

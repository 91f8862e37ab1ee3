"""``python experiments/accumulation_accuracy.py`` (from packages/msda-benchmarks) (GPU): grad_value's error over
max|ref| against float64
grid_sample, per accumulation path (auto, fp32, native), decoder B4 Q300 and encoder B2 in both location
distributions, with the most contributions one element receives (K) and whether the default passes its
tolerance entry (BENCHMARKS.md, "Accumulation paths")."""
from dataclasses import replace

import msda_testkit as kit
import torch
from msda_benchmarks.bench import GPU_CASES

rows = []
for case in GPU_CASES[:2]:
    for layout in ("random", "model_like"):
        c = replace(case, layout=layout)
        for dtype in (torch.float16, torch.bfloat16):
            inputs = kit.make_inputs(c, dtype, device="cuda")
            g = kit.grad_output_for(inputs)
            ref = kit.reference(inputs, backend="grid_sample")["grad_value"]
            scale = ref.abs().max().item()
            errs = {}
            for acc in ("auto", "fp32", "native"):
                got = kit.run(inputs, "triton", g, grad_accum=acc)["grad_value"].double()
                errs[acc] = (got - ref).abs().max().item() / scale
            effect = kit.grad_value_effect("triton", inputs)
            res = kit.compare_results(inputs, {"grad_value": kit.run(inputs, "triton", g)["grad_value"]},
                                      {"grad_value": ref}, grad_value_effect=effect)
            k = kit.parity.max_contributions_per_element(inputs)
            rows.append((case.name, layout, str(dtype)[6:], k, effect, res[0].passed,
                         *(f"{errs[a]:.2e}" for a in ("auto", "fp32", "native"))))
            print(*rows[-1], flush=True)
print("case layout dtype K effect passed auto fp32 native")

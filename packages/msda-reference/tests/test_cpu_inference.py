"""msda-core + msda-reference alone give working CPU inference through torch.ops.msda.deform_attn."""

import msda_core
import msda_testkit as kit
import torch


def test_auto_runs_gather_on_cpu_and_matches_float64():
    inputs = kit.make_inputs(kit.case("decoder_small"), torch.float32)
    assert msda_core.resolve_backend(inputs["value"], inputs["sampling_locations"]) == "gather"
    with torch.inference_mode():
        out = torch.ops.msda.deform_attn(**inputs)
    expected = kit.run(kit.upcast(inputs), "grid_sample")["output"]
    kit.assert_close("output", out, expected, kit.tolerance(torch.float32, "forward"))


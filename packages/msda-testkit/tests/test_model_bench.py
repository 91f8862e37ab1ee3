"""The real-model benchmark: its msda swap computes transformers' attention, and a tiny CPU run is well-formed."""

import json

import msda_testkit as kit
import pytest
import torch
from msda_testkit import model_bench

transformers = pytest.importorskip("transformers")


def test_msda_attention_computes_transformers_attention():
    """The swapped-in core gives the output of the core it replaces, on the op's own inputs."""
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float32)
    shapes = inputs["spatial_shapes"]
    args = (inputs["value"], shapes, [tuple(s) for s in shapes.tolist()], inputs["level_start_index"],
            inputs["sampling_locations"], inputs["attention_weights"], 64)
    expected = MultiScaleDeformableAttention()(*args)
    kit.assert_close("output", model_bench.MsdaAttention()(*args), expected, kit.tolerance(torch.float32, "forward"))


def test_patch_msda_swaps_every_attention_core():
    model = model_bench.build_model(tiny=True)
    cores = sum(type(m).__name__ == "MultiScaleDeformableAttention" for m in model.modules())
    model_bench.patch_msda(model)
    assert cores == 3  # 1 encoder layer, 2 decoder layers
    assert sum(isinstance(m, model_bench.MsdaAttention) for m in model.modules()) == cores
    assert not any(type(m).__name__ == "MultiScaleDeformableAttention" for m in model.modules())


def test_tiny_cpu_run_writes_well_formed_rows(tmp_path):
    path = tmp_path / "model.json"
    assert model_bench.main(["--device", "cpu", "--tiny", "--modes", "eager", "--paths", "pytorch", "msda",
                             "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["environment"]["transformers"] == transformers.__version__
    rows = result["rows"]
    expected = [(path, precision) for precision in ("fp32", "bf16") for path in ("pytorch", "msda")]
    assert [(r["path"], r["precision"]) for r in rows] == expected
    for r in rows:
        assert "error" not in r, r
        assert r["size"] == model_bench.TINY_SIZE and r["mode"] == "eager"
        lo, hi = r["step_spread_ms"]
        assert 0 < lo <= r["step_ms"] <= hi
        assert 0 < r["attention_share"] < 1 and r["attention_ms_per_step"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole benchmark")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert model_bench.main([]) == 2
    assert capsys.readouterr().out.count("\n") == 1

"""The real-model benchmark: its msda path is msda_core.patch on every attention core, and a tiny CPU run is
well-formed."""

import json

import pytest
import torch
from msda_benchmarks import model_bench


def _transformers():
    return pytest.importorskip("transformers")


def test_patch_msda_routes_every_attention_core_through_msda():
    _transformers()
    model = model_bench.build_model(tiny=True)
    cores = sum(type(m).__name__ == "MultiScaleDeformableAttention" for m in model.modules())
    report = model_bench.patch_msda(model)
    assert cores == 3  # 1 encoder layer, 2 decoder layers
    assert len(report.patched) == cores and not report.left_alone
    model.eval()
    with torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 64, 96))
    assert report.calls == cores  # every core ran through msda


def test_tiny_cpu_run_writes_well_formed_rows(tmp_path):
    transformers = _transformers()
    path = tmp_path / "model.json"
    assert model_bench.main(["--device", "cpu", "--tiny", "--modes", "eager", "--paths", "pytorch", "msda",
                             "--seconds", "0.05", "--warmup", "1", "--profile-steps", "1", "--json", str(path)]) == 0
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


def test_the_cpu_runs_only_the_tiny_model(capsys):
    assert model_bench.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().out


def test_profile_steps_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_:
        model_bench.main(["--device", "cpu", "--tiny", "--profile-steps", "0"])
    assert exit_.value.code == 2
    assert "--profile-steps: expected a whole number of steps >= 1, got '0'" in capsys.readouterr().err

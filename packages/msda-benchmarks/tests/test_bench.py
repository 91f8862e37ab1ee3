"""The bench: its bandwidth floor counts what must move, and no more; its CPU comparison."""

import json

import torch
from msda_benchmarks import bench
from msda_testkit.cases import Case, make_inputs


def test_must_move_bytes_counts_only_the_value_rows_that_samples_read():
    """Every sample of level 0 at the centre of its pixel (0, 0) (exactly: the sizes are powers of 2), every other
    level weighted 0: one row of value per (b, m) is read, with weight 1. The backward still writes all of
    grad_value."""
    inputs = make_inputs(Case("pixel_00", batch=2, queries=5, levels=((4, 8), (2, 2))), torch.float32)
    value, loc, weights = inputs["value"], inputs["sampling_locations"], inputs["attention_weights"]
    B, S, M, D = value.shape
    H0, W0 = inputs["spatial_shapes"][0].tolist()
    loc[..., 0] = 0.5 / W0
    loc[..., 1] = 0.5 / H0
    weights[:, :, :, 1:] = 0
    rows_read = B * M * D * 4
    others = loc.nbytes + weights.nbytes + B * loc.shape[1] * M * D * 4  # the locations, weights and output
    gradients = value.nbytes + loc.nbytes + weights.nbytes
    assert bench.must_move_bytes(inputs) == (rows_read + others, rows_read + others + gradients)
    weights[:, :, :, 0] = 0  # nothing weighted: no row of value must move
    assert bench.must_move_bytes(inputs) == (others, others + gradients)


def test_cpu_comparison_times_both_and_writes_json(tmp_path):
    path = tmp_path / "cpu.json"
    tiny = [Case("tiny_decoder", queries=4, heads=2, head_dim=4, levels=((4, 6), (2, 3)), points=2)]
    bench.CPU_CASES, saved = tiny, bench.CPU_CASES
    try:
        assert bench.main(["--device", "cpu", "--layouts", "model_like", "--rounds", "2", "--threads", "1",
                           "--seconds", "0.1", "--json", str(path)]) == 0
    finally:
        bench.CPU_CASES = saved
    rows = json.loads(path.read_text())["rows"]
    assert bench.LAYOUTS[0] == "model_like" and [r["locations"] for r in rows] == ["model_like"]
    for r in rows:
        assert r["rounds"] == 2 and r["max_abs_diff"] < 1e-5
        for name in bench.CPU_IMPLEMENTATIONS:
            for mode in bench.CPU_MODES:
                lo, hi = r[f"{name} {mode} spread ms"]
                assert 0 < lo <= r[f"{name} {mode} ms"] <= hi
        assert r["inference speedup"] == r["mmcv_pytorch inference ms"] / r["gather inference ms"]

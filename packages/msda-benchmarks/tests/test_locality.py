"""The merge factor counts in-map corner contributions over distinct destinations per block of queries."""

import json

import torch
from msda_benchmarks import locality


def _inputs(locations):
    """One 4 x 4 level, one head, one point: each query samples at its (x, y)."""
    Q = len(locations)
    return {"value": torch.zeros(1, 16, 1, 1), "spatial_shapes": torch.tensor([[4, 4]]),
            "level_start_index": torch.tensor([0]),
            "sampling_locations": torch.tensor(locations, dtype=torch.float32).view(1, Q, 1, 1, 1, 2)}


def test_blocks_merge_what_lands_on_the_same_pixels():
    # (0.375, 0.375) is pixel (1, 1)'s centre, 4 corners in the map; (0.875, 0.875) is the last pixel's centre,
    # whose other 3 corners lie past the map's edge: 4 x 4 + 4 x 1 = 20 contributions onto 4 + 1 pixels
    inputs = _inputs([(0.375, 0.375)] * 4 + [(0.875, 0.875)] * 4)
    assert locality.merge_factor(inputs, 1) == 1.0
    assert locality.merge_factor(inputs, 4) == 20 / 5
    assert locality.merge_factor(inputs, 8) == 20 / 5
    assert locality.merge_factor(_inputs([(0.375, 0.375)] * 8), 2) == 2.0


def test_the_tool_writes_a_row_per_layout_and_block(tmp_path, monkeypatch):
    monkeypatch.setattr(locality, "merge_factor", lambda inputs, r: float(r))
    assert locality.main(["--blocks", "1", "16", "--json", str(tmp_path / "l.json")]) == 0
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [(r["locations"], r["block_queries"], r["merge_factor"]) for r in rows] == [
        ("model_like", 1, 1.0), ("model_like", 16, 16.0), ("random", 1, 1.0), ("random", 16, 16.0)]

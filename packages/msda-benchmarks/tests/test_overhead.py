"""The host-overhead tool runs on CPU and leaves the registry and the op namespace as it found them."""

import json

import msda_core
from msda_benchmarks import overhead


def test_overhead_measures_every_layer_and_cleans_up(capsys, tmp_path):
    before = set(msda_core.backends())
    for _ in range(2):  # a second run must be able to define its torch.library op again
        assert overhead.main(["--device", "cpu", "--backend", "gather", "--calls", "5", "--case", "tiny",
                              "--json", str(tmp_path / "o.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "backend" in line or "no kernel" in line]
    rows = [line for line in rows if not line.startswith("{")]  # the environment line
    assert len(rows) == 2 * 6 and all(float(line.split()[-1]) > 0 for line in rows if "forward alone" not in line)
    assert set(msda_core.backends()) == before
    written = json.loads((tmp_path / "o.json").read_text())
    assert written["environment"]["case"] == "tiny" and len(written["rows"]) == 6
    assert all(r["host fwd ms/call"] > 0 for r in written["rows"])

"""The host-overhead tool runs on CPU and leaves the registry and the op namespace as it found them."""

import msda_core
from msda_testkit import overhead


def test_overhead_prints_one_row_per_layer_and_cleans_up(capsys):
    before = set(msda_core.backends())
    for _ in range(2):  # a second run must be able to define its torch.library ops again
        assert overhead.main(["--device", "cpu", "--backend", "gather", "--calls", "10"]) == 0
    table = capsys.readouterr().out
    for layer in ("autograd.Function", "op pair, msda's schemas, no kernel", "calling backend 'gather' directly",
                  "no-op backend", "msda op, backend 'gather'"):
        assert layer in table
    assert set(msda_core.backends()) == before

import pytest
import torch
from msda_testkit.replay import assert_replays_bit_exact


def test_equal_replays_pass_and_return_the_first_run_by_name():
    """(A real backend's replays: test_reference_backends.py for gather, verify's stage 4 for any.)"""
    calls = []

    def twice_and_cumsum(x):
        calls.append(1)
        return x * 2, x.cumsum(0)

    x = torch.arange(6.0).reshape(2, 3)
    outputs = assert_replays_bit_exact(twice_and_cumsum, {"x": x}, replays=4)
    assert len(calls) == 4 and list(outputs) == ["output[0]", "output[1]"]
    assert torch.equal(outputs["output[1]"], x.cumsum(0))


def test_a_one_ulp_difference_is_reported_with_its_place():
    calls = []

    def drifting(x):
        calls.append(1)
        out = x.clone()
        if len(calls) == 3:
            out[1, 2] = torch.nextafter(out[1, 2], torch.tensor(float("inf")))
        return out

    with pytest.raises(AssertionError, match=r"replay 2 of 5: output: 1 elements differ, the first at \(1, 2\)"):
        assert_replays_bit_exact(drifting, {"x": torch.ones(3, 4)}, replays=5)


def test_signed_zero_and_nan_payloads_count():
    flips = iter([0.0, -0.0])
    with pytest.raises(AssertionError, match="1 elements differ"):
        assert_replays_bit_exact(lambda: torch.tensor([next(flips)]), {}, replays=2)
    payloads = iter([0x7FC00000, 0x7FC00001])  # two quiet NaNs with different payloads
    def nan():
        return torch.tensor([next(payloads)], dtype=torch.int32).view(torch.float32)
    with pytest.raises(AssertionError, match="1 elements differ"):
        assert_replays_bit_exact(nan, {}, replays=2)

import pytest
import torch

import msda_testkit as kit
from msda_testkit.replay import assert_replays_bit_exact


def test_deterministic_backend_replays_forward_and_gradients():
    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float32)
    grad_output = kit.grad_output_for(inputs)
    outputs = assert_replays_bit_exact(lambda **inp: kit.run(inp, "gather", grad_output), inputs, replays=4)
    assert set(outputs) == {"output", *kit.GRAD_NAMES}


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
    nan = lambda: torch.tensor([next(payloads)], dtype=torch.int32).view(torch.float32)
    with pytest.raises(AssertionError, match="1 elements differ"):
        assert_replays_bit_exact(nan, {}, replays=2)

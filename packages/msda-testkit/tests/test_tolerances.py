import msda_testkit as kit
import pytest
import torch

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("key", list(kit.TOLERANCES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_entry_is_possible_but_tight(key):
    tol = kit.TOLERANCES[key]
    u = UNIT_ROUNDOFF[key[0]]
    assert tol.rtol >= u, "tighter than one rounding of the result: no correct kernel could pass"
    if key[1] == "atomic" and key[0] in (torch.float16, torch.bfloat16):
        # derived as sqrt(K) * u of the scale: the table must agree with its own derivation
        assert tol.atol == pytest.approx(tol.max_contributions ** 0.5 * u, rel=0.05)
    else:
        # a convention slip (the -0.5 shift, a swapped corner) moves results by O(0.1-1) of the scale
        assert tol.rtol < 0.01 and tol.atol < 0.1, "too loose to catch a convention error"
    assert (tol.max_contributions is not None) == (key[1] == "atomic")


def test_every_dtype_has_every_effect():
    for dtype in UNIT_ROUNDOFF:
        for effect in ("forward", "gradient", "atomic"):
            kit.tolerance(dtype, effect)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # the Triton backend's deterministic mode
        kit.tolerance(dtype, "fixed_point")
    with pytest.raises(KeyError, match="no tolerance for dtype torch.int32"):
        kit.tolerance(torch.int32, "forward")

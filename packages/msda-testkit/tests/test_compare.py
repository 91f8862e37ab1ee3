import math

import msda_testkit as kit
import torch

TOL = kit.Tolerance(rtol=1e-3, atol=1e-4, reason="test entry")


def test_identical_passes_and_reports_zero_error():
    x = torch.randn(100, dtype=torch.float64)
    r = kit.compare("x", x, x.clone(), TOL)
    assert r.passed and r.max_abs_err == 0 and r.n == 100


def test_planted_error_is_found_and_reported():
    x = torch.randn(100, dtype=torch.float64)
    y = x.clone()
    y[17] += 0.5
    r = kit.compare("x", y, x, TOL)
    assert not r.passed and r.n_bad == 1 and math.isclose(r.max_abs_err, 0.5, rel_tol=1e-9)
    assert "FAILED: 1 of 100 elements outside" in str(r)


def test_error_within_atol_of_the_scale_passes():
    x = torch.tensor([1000.0, 0.0], dtype=torch.float64)
    r = kit.compare("x", x + torch.tensor([0.0, 0.05]), x, TOL)  # 0.05 <= 1e-4 * 1000
    assert r.passed


def test_nan_must_meet_nan_and_inf_the_same_inf():
    e = torch.tensor([math.nan, math.inf, 1.0], dtype=torch.float64)
    assert kit.compare("x", e.clone(), e, TOL).passed
    assert kit.compare("x", torch.tensor([0.0, math.inf, 1.0]), e, TOL).n_bad == 1
    assert kit.compare("x", torch.tensor([math.nan, -math.inf, 1.0]), e, TOL).n_bad == 1
    assert kit.compare("x", torch.tensor([math.nan, math.inf, math.nan]), e, TOL).n_bad == 1


def test_a_norm_wise_entry_judges_the_errors_norm_and_each_nonfinite_mismatch():
    """An "accumulated" entry: one element far off (relative to itself) passes while the error's norm stays within
    rtol of the reference's, a spread of errors past rtol in norm fails, and a NaN where a number was expected
    fails whatever the norm."""
    tol = kit.tolerance(torch.bfloat16, "accumulated")
    x = torch.randn(10000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    one_off = x.clone()
    one_off[0] += tol.rtol / 2 * x.norm()  # 50 rtol of the norm of one element of 10000 (about 50 rtol of itself)
    assert kit.compare("x", one_off, x, tol).passed and (one_off[0] - x[0]).abs() > 10 * tol.rtol * x[0].abs()
    spread = x * (1 + 2 * tol.rtol)
    result = kit.compare("x", spread, x, tol)
    assert not result.passed and math.isclose(result.norm_err, 2 * tol.rtol, rel_tol=1e-6)
    assert "norm-wise err" in str(result)
    nan = x.clone()
    nan[3] = math.nan
    assert kit.compare("x", nan, x, tol).n_bad == 1

"""Comparisons that say how far off a result is, not only whether it passed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tolerances import Tolerance


@dataclass(frozen=True)
class Comparison:
    name: str
    max_abs_err: float  # over elements finite in both
    max_rel_err: float  # max_abs_err relative to the scale
    allowed_abs: float  # atol * scale: what an element near zero may be off by
    n_bad: int  # elements outside the tolerance, NaN/inf mismatches included
    n: int
    n_ignored: int  # elements the caller excluded (see compare's ``ignore``)
    tolerance: Tolerance
    norm_err: float | None = None  # ||actual - expected||_2 / ||expected||_2, for a norm-wise tolerance

    @property
    def passed(self) -> bool:
        return self.n_bad == 0

    def __str__(self) -> str:
        verdict = "ok" if self.passed else f"FAILED: {self.n_bad} of {self.n} elements outside"
        if self.n_ignored:
            verdict += f" ({self.n_ignored} ignored)"
        if self.norm_err is not None:
            verdict = "ok" if self.passed else "FAILED: a non-finite mismatch or the norm over its bound"
            return (f"{self.name}: norm-wise err {self.norm_err:.3g}, allowed {self.tolerance.rtol:.3g}; max abs err "
                    f"{self.max_abs_err:.3g} ({self.max_rel_err:.3g} of scale) -> {verdict} [{self.tolerance.reason}]")
        return (f"{self.name}: max abs err {self.max_abs_err:.3g} ({self.max_rel_err:.3g} of scale), "
                f"allowed {self.allowed_abs:.3g} + {self.tolerance.rtol:g}*|expected| -> {verdict} "
                f"[{self.tolerance.reason}]")


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance,
            ignore: torch.Tensor | None = None) -> Comparison:
    """Compare in float64 on the CPU; NaN must meet NaN and an infinity the same infinity.

    ``ignore`` (bool, broadcastable) marks elements whose expected value is not defined to the precision
    compared, such as location gradients at pixel kinks; they are counted but not judged.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    both_finite = torch.isfinite(a) & torch.isfinite(e)
    same_special = (torch.isnan(a) & torch.isnan(e)) | ((a == e) & ~torch.isfinite(e))
    scale = e[torch.isfinite(e)].abs().max().item() if bool(torch.isfinite(e).any()) else 0.0
    scale = scale or 1.0
    err = torch.where(both_finite, (a - e).abs(), torch.zeros_like(a))
    # Below the dtype's smallest normal number its spacing is fixed (subnormals): rounding there errs by up to
    # half of it, however small the result, so each element may also be off by one subnormal step (fp16: 6e-8).
    finfo = torch.finfo(actual.dtype) if actual.is_floating_point() else None
    underflow = finfo.smallest_normal * finfo.eps if finfo else 0.0
    allowed = tol.atol * scale + tol.rtol * e.abs() + underflow
    mismatched = ~both_finite & ~same_special  # a NaN or an infinity the other side does not share
    bad = (both_finite & (err > allowed)) | mismatched
    n_ignored = 0
    if ignore is not None:
        ignore = ignore.to("cpu").expand_as(bad)
        bad, mismatched, err = bad & ~ignore, mismatched & ~ignore, torch.where(ignore, 0.0, err)
        n_ignored = int(ignore.sum())
    max_abs = err.max().item() if err.numel() else 0.0
    n_bad, norm_err = int(bad.sum()), None
    if tol.norm_wise:  # non-finite mismatches count one by one, the finite elements' errors by their norm
        norm_err = torch.linalg.vector_norm(err).item() / (
            torch.linalg.vector_norm(torch.where(both_finite, e, 0.0)).item() or 1.0)
        n_bad = int(mismatched.sum()) + int(norm_err > tol.rtol)
    return Comparison(name, max_abs, max_abs / scale, tol.atol * scale, n_bad, a.numel(), n_ignored, tol, norm_err)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Comparison:
    result = compare(name, actual, expected, tol)
    if not result.passed:
        raise AssertionError(str(result))
    return result

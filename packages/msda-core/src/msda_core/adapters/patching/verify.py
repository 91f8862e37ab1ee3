"""The first-call check: msda's output against the original's on the same inputs, upcast to float64.

msda's forward is held, in its tests, to a float64 reference computed from the same inputs within the tolerance
table's ``forward`` entry for its output dtype. The original is the reference here: run once on the call's inputs
cloned and upcast (its math, not its rounding), with no autograd graph, autocast off and the random generators
restored after. Only the forward is compared: at a pixel knot the location gradients of two correct
implementations may legitimately take different sides (README, "Knots"), while their outputs agree.
"""

from __future__ import annotations

import contextlib

import torch

# (rtol, atol) of msda's forward against a float64 reference of the same inputs, per output dtype: an element
# passes when |msda - reference| <= atol * scale + rtol * |reference|, scale the largest finite |reference|.
# These are msda_testkit.tolerances' "forward" entries (msda-core does not depend on the testkit; a test checks
# they agree): fp32 accumulation then one rounding to the output dtype, so rtol = 2u of a half dtype and atol the
# fp32 sums' n*u; float64 sums err by ~1e-14. A convention slip (another coordinate system, units, layout) is
# O(1) of the scale, five orders above any of them.
FORWARD_BOUNDS = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 2e-5),
    torch.float16: (1e-3, 2e-5),
    torch.bfloat16: (8e-3, 2e-5),
}
REFERENCE_DTYPE = torch.float64


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _upcast(tree):
    """Fresh copies of every tensor (floating ones in float64), so the original cannot touch the caller's."""
    if isinstance(tree, torch.Tensor):
        dtype = REFERENCE_DTYPE if tree.is_floating_point() else tree.dtype
        return tree.detach().to(dtype=dtype, copy=True)
    if isinstance(tree, (list, tuple)):
        return type(tree)(map(_upcast, tree)) if type(tree) in (list, tuple) else tree
    if isinstance(tree, dict):
        return {k: _upcast(v) for k, v in tree.items()}
    return tree


def skip_reason(args, kwargs) -> str | None:
    """Why this call is not one to verify on (it is then verified at a later one), or None."""
    if torch.jit.is_tracing():
        return "traced"
    tensors = list(_tensors((args, kwargs)))
    if not tensors or any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta"
                          for t in tensors):
        return "not plain tensors"  # fake, meta or subclassed tensors: nothing to compare
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"  # the comparison reads a number back, which a capture forbids
    return None


def reference(original, args, kwargs):
    """``original``'s output on the inputs upcast, computed apart from the caller's autograd, autocast and
    random state; raises what the original raises."""
    device = next(_tensors((args, kwargs))).device
    # fork_rng restores the CPU generator, and the accelerator's when the inputs are on one.
    accelerator = device.type not in ("cpu", "meta")
    rng = torch.random.fork_rng(devices=[device.index or 0] if accelerator else [],
                                device_type=device.type if accelerator else "cuda")
    autocast = torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type) else (
        contextlib.nullcontext())
    with rng, autocast, torch.no_grad():
        return original(*_upcast(args), **_upcast(kwargs))


def compare(actual, expected) -> tuple[float | None, str]:
    """How far msda's ``actual`` is from the reference ``expected``: (the largest |difference| as a fraction of
    what the bound allows there, 1 or more failing; None when they cannot be compared) and a description."""
    if not isinstance(expected, torch.Tensor):
        return None, f"the original returned {type(expected).__name__}, msda a tensor"
    if expected.shape != actual.shape:
        return None, f"the original returned shape {tuple(expected.shape)}, msda {tuple(actual.shape)}"
    rtol, atol = FORWARD_BOUNDS.get(actual.dtype, FORWARD_BOUNDS[torch.float32])
    if expected.dtype != REFERENCE_DTYPE:  # the original rounded to its own dtype: its error adds to msda's
        e_rtol, e_atol = FORWARD_BOUNDS.get(expected.dtype, FORWARD_BOUNDS[torch.float32])
        rtol, atol = rtol + e_rtol, atol + e_atol
    dtype = str(actual.dtype).removeprefix("torch.")
    actual, expected = actual.detach().to(torch.float64), expected.to(torch.float64)
    finite = expected.isfinite()
    scale = expected[finite].abs().max().item() if finite.any() else 0.0
    same_nonfinite = (actual == expected) | (actual.isnan() & expected.isnan())  # inf and inf, nan and nan
    difference = torch.where(finite & actual.isfinite(), (actual - expected).abs(),
                             torch.where(same_nonfinite, 0.0, torch.inf))
    allowed = atol * scale + rtol * expected.abs()
    ratio = torch.where(difference == 0, 0.0, difference / torch.where(finite, allowed, 1.0))
    worst = ratio.max().item() if ratio.numel() else 0.0
    largest = difference.max().item() if difference.numel() else 0.0
    return worst, (f"max |msda - original| {largest:.3g} (output scale {scale:.3g}), {worst:.2g} of the {dtype} "
                   f"bound")

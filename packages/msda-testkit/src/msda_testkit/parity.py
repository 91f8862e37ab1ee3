"""Cross-backend parity: a backend's forward and three gradients against a reference on upcast inputs."""

from __future__ import annotations

import torch

import msda_core

from .cases import grad_output_for, upcast
from .compare import compare
from .tolerances import tolerance

GRAD_NAMES = ("grad_value", "grad_sampling_locations", "grad_attention_weights")
_DIFFERENTIABLE = ("value", "sampling_locations", "attention_weights")


def run(inputs: dict, backend: str, grad_output: torch.Tensor | None = None, **op_kwargs) -> dict:
    """Forward (and backward when grad_output is given) through torch.ops.msda.deform_attn.

    Returns {"output": ..., "grad_value": ..., ...}; the inputs are left untouched.
    """
    leaves = {k: (v.detach().requires_grad_(grad_output is not None) if k in _DIFFERENTIABLE else v)
              for k, v in inputs.items()}
    out = msda_core.deform_attn(**leaves, backend=backend, **op_kwargs)
    result = {"output": out.detach()}
    if grad_output is not None:
        grads = torch.autograd.grad(out, [leaves[k] for k in _DIFFERENTIABLE], grad_output)
        result.update(zip(GRAD_NAMES, grads))
    return result


def reference(inputs: dict, backward: bool = True, backend: str = "grid_sample", seed: int = 1) -> dict:
    """The expected results: ``backend`` on the inputs upcast to float64, with the seeded grad_output."""
    grad_output = grad_output_for(inputs, seed).double() if backward else None
    return run(upcast(inputs, torch.float64), backend, grad_output)


def near_pixel_kinks(inputs: dict) -> torch.Tensor:
    """(B, Q, M, L, P, 1) bool: samples whose pixel coordinate lies within its own rounding error of an
    integer. The location gradient jumps there (the corner set changes, OP.md), so a kernel computing
    x = loc * W - 0.5 in fp32 may rightly land on the other side than the float64 reference. Backends
    compute coordinates in fp32 (fp64 for fp64 locations); a few roundings of |x| <= W + 1 give
    |error| <= 4u(W + 1); the band is twice that.
    """
    loc = inputs["sampling_locations"]
    u = 2.0 ** -53 if loc.dtype == torch.float64 else 2.0 ** -24
    shapes = inputs["spatial_shapes"].to(loc.device, torch.float64)
    size = shapes.flip(-1).reshape(1, 1, 1, -1, 1, 2)  # (W, H) per level, matching (x, y)
    x = loc.double() * size - 0.5
    near = ((x - x.round()).abs() <= 8 * u * (size + 1)).any(-1, keepdim=True)
    return near


def compare_results(inputs: dict, actual: dict, expected: dict, *, atomic_grad_value: bool = False) -> list:
    """Judge each result with the tolerance of its own dtype (OP.md: gradients take their input's dtype).

    ``atomic_grad_value`` selects the atomic-reordering entry for grad_value. Location gradients of
    samples on pixel kinks are not judged (see near_pixel_kinks).
    """
    dtypes = {"output": inputs["value"].dtype, "grad_value": inputs["value"].dtype,
              "grad_sampling_locations": inputs["sampling_locations"].dtype,
              "grad_attention_weights": inputs["attention_weights"].dtype}
    results = []
    for name in actual:
        effect = "forward" if name == "output" else ("atomic" if name == "grad_value" and atomic_grad_value
                                                     else "gradient")
        if actual[name].dtype != dtypes[name]:
            raise AssertionError(f"{name}: dtype {actual[name].dtype}, expected {dtypes[name]}")
        ignore = near_pixel_kinks(inputs) if name == "grad_sampling_locations" else None
        results.append(compare(name, actual[name], expected[name], tolerance(dtypes[name], effect), ignore))
    return results


def check_parity(inputs: dict, backend: str, reference_backend: str = "grid_sample", *, backward: bool = True,
                 seed: int = 1, **op_kwargs) -> list:
    """``backend`` on ``inputs`` against ``reference_backend`` on the same inputs upcast to float64.

    A backend that is not deterministic scatters grad_value with atomics: its atomic entry applies.
    """
    grad_output = grad_output_for(inputs, seed) if backward else None
    actual = run(inputs, backend, grad_output, **op_kwargs)
    expected = reference(inputs, backward, reference_backend, seed)
    atomic = not msda_core.backends()[backend].deterministic
    return compare_results(inputs, actual, expected, atomic_grad_value=atomic)


def assert_parity(inputs: dict, backend: str, reference_backend: str = "grid_sample", **kwargs) -> list:
    results = check_parity(inputs, backend, reference_backend, **kwargs)
    if any(not r.passed for r in results):
        raise AssertionError(f"{backend} vs {reference_backend}:\n" + "\n".join(str(r) for r in results))
    return results

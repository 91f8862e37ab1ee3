"""Cross-backend parity: a backend's forward and three gradients against a reference on upcast inputs."""

from __future__ import annotations

import msda_core
import torch

from .cases import DIFFERENTIABLE, grad_output_for, upcast
from .compare import compare
from .tolerances import tolerance

GRAD_NAMES = ("grad_value", "grad_sampling_locations", "grad_attention_weights")


def run(inputs: dict, backend: str, grad_output: torch.Tensor | None = None, **op_kwargs) -> dict:
    """Forward (and backward when grad_output is given) through torch.ops.msda.deform_attn.

    Returns {"output": ..., "grad_value": ..., ...}; the inputs are left untouched.
    """
    leaves = {k: (v.detach().requires_grad_(grad_output is not None) if k in DIFFERENTIABLE else v)
              for k, v in inputs.items()}
    out = msda_core.deform_attn(**leaves, backend=backend, **op_kwargs)
    result = {"output": out.detach()}
    if grad_output is not None:
        grads = torch.autograd.grad(out, [leaves[k] for k in DIFFERENTIABLE], grad_output)
        result.update(zip(GRAD_NAMES, grads))
    return result


def reference(inputs: dict, backward: bool = True, backend: str = "grid_sample", seed: int = 1) -> dict:
    """The expected results: ``backend`` on the inputs upcast to float64, with the seeded grad_output."""
    grad_output = grad_output_for(inputs, seed).double() if backward else None
    return run(upcast(inputs, torch.float64), backend, grad_output)


def near_pixel_kinks(inputs: dict) -> torch.Tensor:
    """(B, Q, M, L, P, 1) bool: samples whose pixel coordinate lies within its own rounding error of an
    integer. The location gradient jumps there (the corner set changes, docs/math.md), so a kernel computing
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


def max_contributions_per_element(inputs: dict) -> int:
    """The largest number of in-map corner contributions that land on one element of grad_value (K):
    how many atomic adds one element receives. Counted on the inputs' device."""
    loc = inputs["sampling_locations"].double()
    B, Q, M, L, P, _ = loc.shape
    shapes = inputs["spatial_shapes"].tolist()
    S = sum(h * w for h, w in shapes)
    counts = torch.zeros(B * M * S, dtype=torch.int64, device=loc.device)
    head = (torch.arange(B, device=loc.device).view(B, 1, 1, 1) * M
            + torch.arange(M, device=loc.device).view(1, 1, M, 1)) * S
    start = 0
    for level, (H, W) in enumerate(shapes):
        x, y = loc[:, :, :, level, :, 0] * W - 0.5, loc[:, :, :, level, :, 1] * H - 0.5
        finite = torch.isfinite(x) & torch.isfinite(y)
        x0 = torch.floor(torch.where(finite, x, -2.0)).long()
        y0 = torch.floor(torch.where(finite, y, -2.0)).long()
        for dy in (0, 1):
            for dx in (0, 1):
                row, col = y0 + dy, x0 + dx
                inside = finite & (row >= 0) & (row < H) & (col >= 0) & (col < W)
                counts += torch.bincount((head + start + row * W + col)[inside], minlength=counts.numel())
        start += H * W
    return int(counts.max()) if counts.numel() else 0


def grad_value_effect(backend: str, inputs: dict, grad_accum: str = "auto", deterministic: bool = False) -> str:
    """The tolerance entry that judges ``backend``'s grad_value on ``inputs``, from its declarations:
    "gradient" where its backward is reproducible on the device, or where it accumulated half values in
    fp32 (grad_accum "fp32") and rounded once; "accumulated" (norm-wise) for half values under its own
    policy (grad_accum "auto", the op's default); "fixed_point" for its deterministic mode; else "atomic"."""
    declared = msda_core.backends()[backend]
    if inputs["value"].device.type in declared.reproducible_on:
        return "gradient"
    if deterministic and declared.deterministic_on_request:
        return "fixed_point"
    if declared.honors_grad_accum and grad_accum != "native" and inputs["value"].dtype != torch.float32:
        return "gradient" if grad_accum == "fp32" else "accumulated"
    return "atomic"


def compare_results(inputs: dict, actual: dict, expected: dict, *, grad_value_effect: str = "gradient") -> list:
    """Judge each result with the tolerance of its own dtype (docs/math.md: gradients take their input's dtype).

    ``grad_value_effect`` selects grad_value's entry: "gradient", "atomic" or "fixed_point" (how it was
    accumulated; see tolerances). Location gradients of
    samples on pixel kinks are not judged (see near_pixel_kinks).
    """
    dtypes = {"output": inputs["value"].dtype, "grad_value": inputs["value"].dtype,
              "grad_sampling_locations": inputs["sampling_locations"].dtype,
              "grad_attention_weights": inputs["attention_weights"].dtype}
    results = []
    for name in actual:
        effect = {"output": "forward", "grad_value": grad_value_effect}.get(name, "gradient")
        if actual[name].dtype != dtypes[name]:
            raise AssertionError(f"{name}: dtype {actual[name].dtype}, expected {dtypes[name]}")
        tol = tolerance(dtypes[name], effect)
        if tol.max_contributions is not None and actual[name].numel():
            k = max_contributions_per_element(inputs)
            if k > tol.max_contributions:
                raise ValueError(f"{name}: {k} atomic adds reach one element, beyond the K <= "
                                 f"{tol.max_contributions} the ({dtypes[name]}, {effect!r}) tolerance holds for")
        ignore = near_pixel_kinks(inputs) if name == "grad_sampling_locations" else None
        results.append(compare(name, actual[name], expected[name], tol, ignore))
    return results


def check_parity(inputs: dict, backend: str, reference_backend: str = "grid_sample", *, backward: bool = True,
                 seed: int = 1, grad_output: torch.Tensor | None = None, expected: dict | None = None,
                 nonfinite_kind_matters: bool = True, **op_kwargs) -> list:
    """``backend`` on ``inputs`` against ``reference_backend`` on the same inputs upcast to float64: the one "run,
    reference, compare" of the tests and tools.

    ``grad_output`` replaces the seeded one; ``expected`` is the reference's results where the caller has them
    already (computed with the same grad_output); ``nonfinite_kind_matters=False`` (inf inputs): results must be
    non-finite exactly where the reference's are, NaN or inf alike (inf * 0 terms make NaN of an inf in one
    summation order). grad_value is judged by the entry grad_value_effect picks from the backend's declarations.
    """
    if backward and grad_output is None:
        grad_output = grad_output_for(inputs, seed)
    actual = run(inputs, backend, grad_output if backward else None, **op_kwargs)
    if expected is None:
        expected = run(upcast(inputs, torch.float64), reference_backend,
                       grad_output.double() if backward and grad_output is not None else None)
    if not nonfinite_kind_matters:
        actual, expected = ({k: torch.where(v.isfinite(), v, torch.nan) for k, v in r.items()}
                            for r in (actual, expected))
    effect = grad_value_effect(backend, inputs, op_kwargs.get("grad_accum", "auto"),
                               bool(op_kwargs.get("deterministic")))
    return compare_results(inputs, actual, expected, grad_value_effect=effect)


def assert_parity(inputs: dict, backend: str, reference_backend: str = "grid_sample", **kwargs) -> list:
    results = check_parity(inputs, backend, reference_backend, **kwargs)
    if any(not r.passed for r in results):
        raise AssertionError(f"{backend} vs {reference_backend}:\n" + "\n".join(str(r) for r in results))
    return results

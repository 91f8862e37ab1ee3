"""The check every integration test runs: a model's own PyTorch path against the same model patched by msda, in
float64 on the CPU, outputs and every parameter gradient, with the patched calls counted.

Sampling locations are kept off the pixel grid's knots (integer x = loc*W - 0.5 or y), where bilinear
sampling's location gradient jumps and two correct implementations may take different sides: every
``sampling_offsets`` layer gets random weights and biases (the libraries' own initialisation puts encoder
samples exactly on pixel centres plus whole-pixel offsets, i.e. on knots), so locations are continuous random
values, and the recording backend measures how close any in-map sample came to a knot (float64 coordinates of
the two paths differ by ~1e-15 * W, so 1e-12 leaves a thousandfold margin). The recording backend also adds
nothing: what reaches a test's outputs is what the gather backend computed.
"""

from __future__ import annotations

import dataclasses
import pickle

import msda_core
import msda_testkit as kit
import torch
from torch import nn

OUTPUT = kit.Tolerance(0.0, 1e-10, "whole model in float64: the op's ~1e-14 error carried through every later layer; "
                                    "any convention slip is O(1)")
GRADIENT_ERROR = 1e-8  # as OUTPUT, through the backward of every layer
# A gradient is judged relative to at least this fraction of the model's largest one: float64 rounding noise is
# ~1e-16 * (terms summed) of the largest whatever the exact value, and some are exactly 0 (a bias before a norm).
NUMERICALLY_ZERO = 1e-5
KNOT_DISTANCE = 1e-12


class Recording:
    """A backend named "recording": the gather backend, counting its forward and backward calls and the smallest
    distance of an in-map sample from a pixel knot. Registered for the test's duration."""

    name = "recording"

    def __init__(self):
        self.calls, self.backward_calls, self.min_knot_distance = 0, 0, float("inf")

    def __enter__(self):
        gather = msda_core.backends()["gather"]
        msda_core.register(dataclasses.replace(gather, name=self.name, forward=self._forward, backward=self._backward,
                                               auto_devices=frozenset()))
        self._gather = gather
        return self

    def __exit__(self, *exc):
        msda_core.unregister(self.name)

    def _forward(self, inputs):
        self.calls += 1
        with torch.no_grad():
            for level, (H, W) in enumerate(inputs.spatial_shapes.tolist()):
                x = inputs.sampling_locations[:, :, :, level, :, 0].double() * W - 0.5
                y = inputs.sampling_locations[:, :, :, level, :, 1].double() * H - 0.5
                inside = (x > -1) & (x < W) & (y > -1) & (y < H)  # False where not finite
                if inside.any():
                    distance = torch.minimum((x - x.round()).abs(), (y - y.round()).abs())[inside].min().item()
                    self.min_knot_distance = min(self.min_knot_distance, distance)
        return self._gather.forward(inputs)

    def _backward(self, *args):
        self.backward_calls += 1
        return self._gather.backward(*args)


def randomize(model: nn.Module, seed: int = 0) -> None:
    """Random weights the test can see through: every Linear and Conv weight N(0, 1/fan_in), so activations stay
    O(1) through the tiny models (their own init_std of 0.01-0.02 shrank RT-DETR's features to 1e-20 before the
    decoder, hiding its attention), biases N(0, 0.1); every ``sampling_offsets`` layer then moves samples by
    about a pixel, off the knots (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / fan_in ** 0.5)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.1)
        for module in model.modules():
            layer = getattr(module, "sampling_offsets", None)
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
                layer.bias.copy_(torch.rand(layer.bias.shape, generator=g) * 3 - 1.5)


def _tensors(output):
    """The floating tensors of a model's output, in order (ModelOutput, tuples, lists, dicts)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


_PROJECTIONS: dict = {}  # (output index, shape, dtype, device) -> its fixed random projection


def _projection(index: int, like: torch.Tensor) -> torch.Tensor:
    key = (index, tuple(like.shape), like.dtype, like.device)
    if key not in _PROJECTIONS:
        g = torch.Generator().manual_seed(index)
        _PROJECTIONS[key] = torch.randn(like.shape, generator=g, dtype=torch.float64).to(like.device, like.dtype)
    return _PROJECTIONS[key]


def forward_backward(model: nn.Module, inputs: dict):
    """Outputs and each parameter's gradient of a fixed random projection of every finite output element."""
    outputs = _tensors(model(**inputs))
    loss = sum((torch.where(t.isfinite(), t, 0.0) * _projection(i, t)).sum() for i, t in enumerate(outputs))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [t.detach() for t in outputs], dict(zip(names, grads))


@dataclasses.dataclass
class Result:
    mechanisms: list
    output_error: float  # largest max-abs error / scale over the output tensors
    gradient_error: float  # the same over every parameter's gradient
    calls: int
    min_knot_distance: float
    verified: str  # "k/n": sites verified on their first call / sites msda served ("-": no patch)


def check_patched_equals_unpatched(model: nn.Module, inputs: dict) -> Result:
    """Run the model, patch it, run it through msda, unpatch; assert equality, counted calls, the same parameters
    and buffers throughout, and every module back in place after."""
    model.double().eval()
    randomize(model)
    state, modules = model.state_dict(keep_vars=True), list(model.named_modules())
    expected, expected_grads = forward_backward(model, inputs)
    with Recording() as recording, msda_core.use_backend(recording.name), msda_core.patch(model) as report:
        assert report.patched, str(report)
        outputs, grads = forward_backward(model, inputs)
        assert all(p.calls > 0 for p in report.patched), f"a patched module did not run:\n{report}"
        verified = verified_sites(report)
        assert model.state_dict(keep_vars=True).keys() == state.keys()
        assert all(t is state[k] for k, t in model.state_dict(keep_vars=True).items())
        # what patch put into the model pickles, so the model still does where its library's does
        pickle.dumps([p.replacement for p in report.patched if not p.mechanism.startswith("global")])
    assert recording.calls > 0 and recording.calls == report.calls
    assert recording.min_knot_distance > KNOT_DISTANCE, recording.min_knot_distance
    assert [(n, id(m)) for n, m in model.named_modules()] == [(n, id(m)) for n, m in modules]  # restored exactly
    output_error = 0.0
    assert len(outputs) == len(expected)
    for i, (actual, wanted) in enumerate(zip(outputs, expected)):
        output_error = max(output_error, kit.assert_close(f"output {i}", actual, wanted, OUTPUT).max_rel_err)
    assert grads.keys() == expected_grads.keys()
    assert all((grads[n] is None) == (g is None) for n, g in expected_grads.items())
    return Result(sorted({p.mechanism.split(":")[0] for p in report.patched}), output_error,
                  _gradient_error(grads, expected_grads), report.calls, recording.min_knot_distance, verified)


def verified_sites(report) -> str:
    """Asserts that every site msda served was verified against its original on its first call (and no module was
    sent back); returns "k/n", k verified of n served."""
    assert not any(p.reverted for p in report.patched) and not [e for e in report.left_alone if "differs" in e.reason]
    served = [site for p in report.patched for site in p.sites if site.calls]
    unverified = [site.state for site in served if not site.state.startswith("verified on its first call: ")]
    assert not unverified, f"{unverified}\n{report}"
    return f"{len(served)}/{len(served)}"


def _gradient_error(grads: dict, expected: dict) -> float:
    """The largest error of a parameter's gradient relative to its own largest element, or to NUMERICALLY_ZERO of
    the model's largest where that is more."""
    present = {name: g for name, g in expected.items() if g is not None}
    largest = max(g.abs().max().item() for g in present.values())
    worst = 0.0
    for name, wanted in present.items():
        scale = max(wanted.abs().max().item(), NUMERICALLY_ZERO * largest)
        error = (grads[name] - wanted).abs().max().item() / scale
        assert error <= GRADIENT_ERROR, f"grad {name}: max abs err {error * scale:.3g}, {error:.3g} of {scale:.3g}"
        worst = max(worst, error)
    return worst

"""msda_testkit.conformance: the suite generated from a backend's declarations, and a backend from outside the
repository that passes it through the ``msda.backends`` entry-point group (docs/backends.md's example).

``BACKEND`` below is that example: bilinear sampling written from docs/math.md in plain torch, its backward by
autograd. The test installs it the way a third-party package would (a dist-info with entry_points.txt on the path)
and runs ``python -m msda_testkit.conformance`` on it in a fresh process."""

import subprocess
import sys
from pathlib import Path

import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_testkit import conformance, knots


def _corners(value, locations, H: int, W: int, start: int):
    """One level's samples: for each of the four corners (00, 01, 10, 11) its bilinear weight (B, Q, M, P), whether
    it lies on the map, its pixel index into the level (B, M, Q*P) and the row it reads (B, Q, M, P, D), zeros off
    the map; and the fractions fx, fy and which samples have finite coordinates. value (B, S, M, D), locations
    (B, Q, M, P, 2) of this level."""
    B, _, M, D = value.shape
    Q, P = locations.shape[1], locations.shape[3]
    x, y = locations[..., 0] * W - 0.5, locations[..., 1] * H - 0.5  # the compiled extension's arithmetic
    finite = x.isfinite() & y.isfinite()
    x, y = torch.where(finite, x, -2.0), torch.where(finite, y, -2.0)  # off the map: both corners outside
    x0, y0 = x.floor(), y.floor()
    fx, fy = x - x0, y - y0
    table = value[:, start:start + H * W].permute(0, 2, 1, 3)  # (B, M, H*W, D)
    corners = []
    for dy, dx, weight in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)), (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
        row, col = (y0 + dy).long(), (x0 + dx).long()
        inside = (row >= 0) & (row < H) & (col >= 0) & (col < W)
        pixel = torch.where(inside, row * W + col, 0).permute(0, 2, 1, 3).reshape(B, M, Q * P, 1).expand(-1, -1, -1, D)
        read = torch.gather(table, 2, pixel).reshape(B, M, Q, P, D).permute(0, 2, 1, 3, 4)
        corners.append((weight, inside, pixel, torch.where(inside[..., None], read, 0)))
    return corners, fx, fy, finite


def _levels(inputs):
    for level, ((H, W), start) in enumerate(zip(inputs.spatial_shapes.tolist(), inputs.level_start_index.tolist())):
        yield level, H, W, start, _corners(inputs.value, inputs.sampling_locations[:, :, :, level], H, W, start)


def _sample(corners, finite):
    """(B, Q, M, P, D): the bilinear samples; NaN where a coordinate is not finite (docs/math.md, "Non-finite
    inputs")."""
    sample = sum(weight[..., None] * read for weight, _, _, read in corners)
    return torch.where(finite[..., None], sample, torch.nan)


def example_forward(inputs):
    B, Q, M, D = *inputs.sampling_locations.shape[:3], inputs.value.shape[3]
    out = inputs.value.new_zeros(B, Q, M, D)
    for level, _, _, _, (corners, _, _, finite) in _levels(inputs):
        a = inputs.attention_weights[:, :, :, level]  # (B, Q, M, P)
        out += (a[..., None] * _sample(corners, finite)).sum(3) + (a - a).sum(3)[..., None]  # inf/NaN weight: NaN
    return out.reshape(B, Q, M * D)


def example_backward(grad_output, inputs, grad_accum, deterministic):
    """docs/math.md's gradients: of the weight, the sample; of the location, the weight times the sample's
    derivative (W, H pixels per unit); of value, each corner's weight times the weight, summed onto its pixel."""
    value, locations = inputs.value, inputs.sampling_locations
    B, S, M, D = value.shape
    g = grad_output.reshape(B, -1, M, 1, D)
    grad_value = torch.zeros_like(value.permute(0, 2, 1, 3))  # (B, M, S, D)
    grad_locations = torch.zeros_like(locations)
    grad_weights = torch.zeros_like(inputs.attention_weights)
    for level, H, W, start, (corners, fx, fy, finite) in _levels(inputs):
        a = inputs.attention_weights[:, :, :, level]
        (_, _, _, v00), (_, _, _, v01), (_, _, _, v10), (_, _, _, v11) = corners
        grad_weights[:, :, :, level] = (g * _sample(corners, finite)).sum(-1)
        d_dx = (v01 - v00) * (1 - fy)[..., None] + (v11 - v10) * fy[..., None]
        d_dy = (v10 - v00) * (1 - fx)[..., None] + (v11 - v01) * fx[..., None]
        for axis, (size, derivative) in enumerate(((W, d_dx), (H, d_dy))):
            grad_locations[:, :, :, level, :, axis] = torch.where(finite, a * size * (g * derivative).sum(-1),
                                                                  torch.nan)
        for weight, inside, pixel, _ in corners:
            term = torch.where((inside & finite)[..., None], (a * weight)[..., None] * g, 0)  # (B, Q, M, P, D)
            grad_value[:, :, start:start + H * W].scatter_add_(2, pixel, term.permute(0, 2, 1, 3, 4).flatten(2, 3))
    return grad_value.permute(0, 2, 1, 3), grad_locations, grad_weights


BACKEND = msda_core.Backend("example", example_forward, example_backward, devices=frozenset({"cpu"}),
                            dtypes=frozenset({torch.float32, torch.float64}))


def test_a_backend_from_outside_passes_the_suite_through_its_entry_point(tmp_path):
    """A dist-info on the path whose entry_points.txt names this file's BACKEND, as `pip install` of a third-party
    package would leave: a fresh process finds it in the registry and passes every check of the command."""
    info = tmp_path / "msda_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: msda-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[msda.backends]\nexample = test_conformance:BACKEND\n")
    path = [str(tmp_path), str(Path(__file__).parent), *sys.path]
    result = subprocess.run([sys.executable, "-m", "msda_testkit.conformance", "--backend", "example",
                             "--fuzz-examples", "10"], capture_output=True, text=True, timeout=900,
                            env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == f"{len(lines) - 1} passed, 0 failed, 0 skipped", lines[-1]
    assert any(line.startswith("PASSED  example-cpu-knots-f32-other_sizes") for line in lines)


def test_the_plan_follows_the_declarations():
    """Modes come from the declarations: grad_accum paths only where honored, deterministic=True only where
    requested, float64-only checks only for float64 backends, devices only where declared."""
    msda_core.register(BACKEND)
    try:
        ids = [c.id for c in conformance.plan("example", devices=("cpu", "cuda"))]
        assert all(i.startswith("example-cpu-") for i in ids)
        assert not any("native" in i or "deterministic" in i or "mixed" in i for i in ids)
        assert "example-cpu-gradcheck-f64-d71" in ids and "example-cpu-replay-f32" not in ids
        declared = msda_core.Backend("declared", example_forward, example_backward, devices=frozenset({"cpu"}),
                                     dtypes=frozenset({torch.float16}), honors_grad_accum=True,
                                     deterministic_on_request=True)
        msda_core.register(declared)
        ids = [c.id for c in conformance.plan("declared")]
        for expected in ("declared-cpu-parity-f16-native-tiny", "declared-cpu-parity-f16-fp32-tiny",
                         "declared-cpu-parity-f16/f32-fp32-tiny", "declared-cpu-parity-f16-deterministic-crowded",
                         "declared-cpu-parity-f16/f32-deterministic-tiny", "declared-cpu-replay-f16-deterministic",
                         "declared-cpu-mixed-f16"):
            assert expected in ids, expected
        assert not any("gradcheck" in i or "knots" in i for i in ids)
    finally:
        msda_core.unregister("declared")
        msda_core.unregister("example")


def test_a_waiver_skips_with_its_reason():
    checks = conformance.plan("gather", waive={"*-compile-*": "not here"})
    compile_check = next(c for c in checks if c.id == "gather-cpu-compile-f32")
    with pytest.raises(conformance.Skip, match="not here"):
        compile_check.run()


def test_a_refused_call_is_skipped_with_the_backends_reason():
    """naive's limits refuse large calls: a check on such a call is skipped, naming the limit."""
    inputs = kit.make_inputs(kit.case("decoder_small"), torch.float32)
    with pytest.raises(conformance.Skip, match="too large for the naive Python loops"):
        conformance._refused("naive", inputs)


def test_the_other_side_of_a_knot_is_caught():
    """The knot rule is not vacuous: the derivative towards the lower pixel (x0 = ceil(x) - 1) fails it."""
    inputs = knots.model_init_inputs(((8, 8), (4, 2)), dtype=torch.float64)
    nudged = dict(inputs, sampling_locations=inputs["sampling_locations"] - 1e-12)
    expected = knots.extension_rule(inputs)
    actual = kit.run(nudged, "gather", kit.grad_output_for(inputs))
    assert not kit.compare("grad_sampling_locations", actual["grad_sampling_locations"],
                           expected["grad_sampling_locations"], kit.tolerance(torch.float64, "gradient")).passed
    kit.assert_close("output", actual["output"], expected["output"], kit.tolerance(torch.float64, "gradient"))


def test_a_backend_off_by_a_fraction_of_a_pixel_fails():
    """The suite is not vacuous: the example with its locations moved by 1% of a map fails parity and the knots."""
    moved = msda_core.Backend("moved", lambda inputs: example_forward(inputs._replace(
        sampling_locations=inputs.sampling_locations + 0.01)), example_backward, devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float64}))
    msda_core.register(moved)
    try:
        checks = {c.id: c for c in conformance.plan("moved")}
        for name in ("moved-cpu-parity-f64-tiny", "moved-cpu-knots-f64-powers_of_two"):
            with pytest.raises(AssertionError, match="output"):
                checks[name].run()
    finally:
        msda_core.unregister("moved")

"""The Triton backend on the conventions every backend shares (docs/math.md, "Non-finite inputs"), and its entry point:
a LazyBackend, so that a process that never runs the kernels never imports Triton or Inductor."""

import math
import os
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import msda_testkit as kit
import msda_triton
import pytest
import torch
from triton_env import DEVICE, needs_kernels

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def _inputs(Q=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([(4, 5), (2, 3)])
    return {"value": torch.randn(1, 26, 2, 3, generator=g).to(dtype), "spatial_shapes": shapes,
            "level_start_index": None,
            "sampling_locations": (torch.rand(1, Q, 2, 2, 2, 2, generator=g) * 0.8 + 0.1).to(dtype),
            "attention_weights": torch.rand(1, Q, 2, 2, 2, generator=g).to(dtype)}


def _assert_as_naive(inputs, names=("output",), grad=False):
    on_device = {k: (v.to(DEVICE) if v is not None else None) for k, v in inputs.items()}
    grad_output = kit.grad_output_for(inputs) if grad else None
    actual = kit.run(on_device, "triton", grad_output.to(DEVICE) if grad else None)
    # naive on the same fp32 inputs: its float64 loops judge finiteness in the compute dtype, fp32 here
    expected = kit.run(inputs, "naive", grad_output)
    for name in names:
        a, e = actual[name].cpu(), expected[name]
        assert torch.equal(a.isnan(), e.isnan()), (name, a, e)
        kit.assert_close(name, a[~e.isnan()], e[~e.isnan()], kit.tolerance(a.dtype, "gradient"))
    return expected


@needs_kernels
def test_nonfinite_weights_give_a_nan_row():
    inputs = _inputs()
    weights, locations = inputs["attention_weights"], inputs["sampling_locations"]
    locations[0, 1, 1, 1, 1] = 5.0
    weights[0, 1, 1, 1, 1] = -math.inf  # off the map
    weights[0, 2, 0, 1, 0] = math.nan
    _assert_as_naive(inputs)


@needs_kernels
def test_an_inf_weight_on_the_map_gives_a_nan_row():
    inputs = _inputs()
    inputs["value"].abs_()  # every corner of the same sign: inf, not inf - inf
    inputs["attention_weights"][0, 0, 0, 0, 0] = math.inf
    _assert_as_naive(inputs)


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
def test_locations_whose_pixel_coordinate_overflows_fp32_are_nan():
    inputs = _inputs(Q=3)
    big = torch.finfo(torch.float32).max / 2
    inputs["sampling_locations"][0, 0, 0, 0, 0, 0] = big  # x 5 pixels: overflows
    inputs["sampling_locations"][0, 1, 0, 0, 0, 1] = big / 8  # x 4 pixels: finite, off the map
    expected = _assert_as_naive(inputs, ("output", "grad_sampling_locations", "grad_attention_weights"), grad=True)
    assert expected["output"][0, 0, :3].isnan().all() and not expected["output"][0, 1].isnan().any()


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on inf
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_value_off_the_map_changes_nothing(bad):
    inputs = _inputs()
    inputs["value"][:, [0, 19, 20]] = bad
    inputs["sampling_locations"][:, 0] = -0.5
    inputs["sampling_locations"][:, 1] = 1.5
    _assert_as_naive(inputs, ("output", "grad_sampling_locations", "grad_attention_weights"), grad=True)


@needs_kernels
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sampled_infinite_pixels_give_what_naive_gives(dtype):
    """README, "Non-finite inputs": +-inf where naive gives +-inf, NaN where it gives NaN (infinite_pixel_inputs)."""
    inputs = kit.infinite_pixel_inputs(dtype)
    expected = _assert_as_naive(inputs, ("output", "grad_sampling_locations", "grad_attention_weights"), grad=True)
    assert expected["output"].view(6, -1)[:3].isposinf().all()


def test_the_entry_point_is_lazy_and_agrees_with_the_backend():
    """The entry point names msda_triton.BACKEND, a LazyBackend whose auto_devices and priority are the real
    backend's; importing msda_triton itself imports neither torch's Inductor nor Triton."""
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["msda.backends"]["triton"]
    assert declared == "msda_triton:BACKEND"
    lazy = msda_triton.BACKEND
    from msda_triton.backend import BACKEND
    assert (lazy.name, lazy.auto_devices, lazy.priority) == (BACKEND.name, BACKEND.auto_devices, BACKEND.priority)
    assert lazy.load() is BACKEND


@pytest.mark.parametrize("env", [{}, {"MSDA_BACKEND": "gather"}])
def test_a_cpu_process_never_imports_triton_or_inductor(env):
    """With msda-triton installed on a CPU-only machine, every process's first call imported triton and
    torch._inductor (2.4-2.7 s, 8-10 s under load), although auto picks gather there. (torch itself imports both
    on the first call of any torch.library.custom_op, such as the opaque op grid_sample and naive run in.)"""
    installed = {ep.value for ep in entry_points(group="msda.backends") if ep.name == "triton"}
    if installed != {"msda_triton:BACKEND"}:
        pytest.skip(f"the installed msda-triton is not this checkout's (entry points {installed}): reinstall it")
    script = ("import sys, torch, msda_core\n"
              "v = torch.randn(1, 6, 1, 2); s = torch.tensor([[2, 3]]); loc = torch.rand(1, 2, 1, 1, 1, 2)\n"
              "w = torch.rand(1, 2, 1, 1, 1)\n"
              "msda_core.deform_attn(v, s, None, loc, w)\n"
              "msda_core.deform_attn(v, s, None, loc.requires_grad_(), w).sum().backward()\n"
              "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('torch._inductor')))\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MSDA_BACKEND")}
    result = subprocess.run([sys.executable, "-c", script], env={**clean, "CUDA_VISIBLE_DEVICES": "", **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

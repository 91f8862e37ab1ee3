"""The Triton backend's entry point: a LazyBackend, so that a process that never runs the kernels never imports
Triton or Inductor. (The conventions every backend shares, docs/math.md's "Non-finite inputs": the conformance
suite, test_triton_conformance.py.)"""

import os
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import msda_triton
import pytest

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


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

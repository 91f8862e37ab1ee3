"""The AOTInductor recipe's last step, a C++ program with no Python that runs a ``.pt2`` package, and the model
and inputs the deployment tests export (``python -m msda_benchmarks.deploy_bench`` times them).

``build_aoti_runner`` compiles ``aoti_runner.cpp`` (beside this file) against the installed libtorch with the
system's C++ compiler; ``run_aoti_package`` runs it in a subprocess on tensors passed through files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path

import torch

SOURCE = "aoti_runner.cpp"


def build_aoti_runner(folder: str | os.PathLike, compiler: str | None = None) -> Path:
    """Compile the runner into ``folder``; returns its path. Links libtorch_cuda too where this torch has it."""
    from torch.utils import cpp_extension

    compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or "g++"
    lib = Path(torch.__file__).parent / "lib"
    libraries = ["torch", "torch_cpu", "c10"] + [n for n in ("torch_cuda", "c10_cuda") if any(lib.glob(f"lib{n}.so*"))]
    runner = Path(folder) / "aoti_runner"
    command = [compiler, "-std=c++17", "-O1", "-w", str(files("msda_testkit") / SOURCE), "-o", str(runner),
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), f"-L{lib}", f"-Wl,-rpath,{lib}",
               "-Wl,--no-as-needed", *(f"-l{n}" for n in libraries)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return runner


def run_aoti_package(runner: str | os.PathLike, package: str | os.PathLike, inputs: list, device: str,
                     repeats: int = 0):
    """The package's outputs for ``inputs``, computed by ``runner`` in a process of its own on ``device``; with
    ``repeats``, (outputs, the median ms of that many runs). The process gets no Python path, so nothing of Python
    can be what ran the model."""
    folder = Path(package).parent
    torch.save([t.detach().cpu() for t in inputs], folder / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    command = [str(runner), str(package), str(folder / "inputs.pt"), str(folder / "outputs.pt"), device]
    result = subprocess.run(command + ([str(repeats)] if repeats else []), capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"aoti_runner exited with {result.returncode}:\n{result.stderr[-4000:]}")
    outputs = torch.load(folder / "outputs.pt")
    if not repeats:
        return outputs
    return outputs, float(re.search(r"median_ms=([\d.e+-]+)", result.stdout).group(1))


class Layer(torch.nn.Module):
    """The op inside a model, as deployment tests need one: value from a projection, the op, a projection of its
    output. Takes ``layer_inputs``."""

    def __init__(self, heads: int, head_dim: int, backend: str = "auto"):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.backend = heads, backend
        self.value_proj, self.output_proj = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, features, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        B, S, _ = features.shape
        value = self.value_proj(features).view(B, S, self.heads, -1)
        out = torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights, backend=self.backend)
        return self.output_proj(out)


def layer_inputs(case, dtype=torch.float32, device="cpu", seed: int = 0, **changes) -> tuple:
    """Layer's arguments for a msda_testkit case: its value flattened to (B, S, M*D) features, then the op's
    other inputs (``changes`` replaces some, e.g. level_start_index=None)."""
    from .cases import ARGUMENTS, make_inputs

    inputs = dict(make_inputs(case, dtype, device=device, seed=seed), **changes)
    return (inputs["value"].flatten(2),) + tuple(inputs[k] for k in ARGUMENTS[1:])


def dynamic_batch_and_queries() -> tuple:
    """torch.export's dynamic_shapes for layer_inputs: batch and queries dynamic, the level tables static."""
    batch, queries = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("queries", min=1, max=4096)
    return ({0: batch}, None, None, {0: batch, 1: queries}, {0: batch, 1: queries})

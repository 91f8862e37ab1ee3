"""The AOTInductor recipe's last step: a C++ program with no Python that runs a ``.pt2`` package; and
``python -m msda_testkit.deploy``, which times the op eagerly, under torch.compile (default and reduce-overhead)
and as an AOTInductor package run from that program.

``build_aoti_runner`` compiles ``aoti_runner.cpp`` (beside this file) against the installed libtorch with the
system's C++ compiler; ``run_aoti_package`` runs it in a subprocess on tensors passed through files.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
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


def _wall_ms(fn, device, repeats: int) -> float:
    """Median wall-clock ms of ``fn`` followed by a device sync, after 3 warm-up calls: as aoti_runner times."""
    times = []
    for i in range(3 + repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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


class _Op(torch.nn.Module):
    """The op alone, as a module: what torch.export packages."""

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights)


def main(argv=None) -> int:
    from tabulate import tabulate

    from . import cli
    from .cases import ARGUMENTS, DIFFERENTIABLE, case, grad_output_for, make_inputs

    parser = cli.parser("msda_testkit.deploy", __doc__)
    cli.add_device(parser)
    parser.add_argument("--cases", nargs="*", default=["decoder_b4_q300", "encoder_b2"], help="msda_testkit cases")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the inputs' dtype")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per figure")
    parser.add_argument("--json", default="deploy.json", help="where the figures go, in the current folder by default")
    args = parser.parse_args(argv)
    device = cli.device(parser.prog, args.device)
    dtype, rows = getattr(torch, args.dtype), []
    folder = Path(tempfile.mkdtemp(prefix="msda-deploy-"))
    runner = build_aoti_runner(folder)
    for name in args.cases:
        inputs = make_inputs(case(name), dtype, device=device)
        call = [inputs[k] for k in ARGUMENTS]
        grad_output = grad_output_for(inputs)
        leaves = [inputs[k].detach().requires_grad_() for k in DIFFERENTIABLE]
        with_leaves = [leaves[0], call[1], call[2], leaves[1], leaves[2]]
        op = _Op()
        row = {"case": name, "dtype": args.dtype}
        for mode, fn in (("eager", op), ("compiled", torch.compile(op, fullgraph=True)),
                         ("reduce-overhead", torch.compile(op, mode="reduce-overhead", fullgraph=True))):
            with torch.no_grad():
                row[f"{mode} fwd"] = _wall_ms(lambda: fn(*call), device, args.repeats)
            row[f"{mode} fwd+bwd"] = _wall_ms(lambda: torch.autograd.grad(fn(*with_leaves), leaves, grad_output),
                                              device, args.repeats)
        with torch.no_grad():
            program = torch.export.export(op, tuple(call))
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"{name}.pt2"))
        _, row["AOTI (C++) fwd"] = run_aoti_package(runner, package, call, device.type, args.repeats)
        rows.append(row)
        print(row, flush=True)
    environment = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu"}
    print(environment)
    print(tabulate([r.values() for r in rows], headers=list(rows[0]), floatfmt=".4f"))
    cli.write_results(args.json, environment, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

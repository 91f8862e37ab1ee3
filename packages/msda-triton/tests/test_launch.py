"""launcher.launch: an eager launch is repeated through Triton's compiled kernel only for tensors that Triton would
specialize alike and that fix the same integer arguments (the same shapes); the replay, the one use of a private
Triton API, turns itself off when that API is not what it expects, and the JIT, its fallback, launches with the
same arguments.

Stand-ins replace the JIT function and its CompiledKernel, so this runs without a GPU or the interpreter;
the GPU suite runs the real kernels through the same path (test_gpu.py also mixes aligned and misaligned
inputs of one shape).
"""

import pytest
import torch
from msda_triton import launcher
from triton.compiler import CompiledKernel


class _Compiled(CompiledKernel):
    """A CompiledKernel that records the launches made through it."""

    def __init__(self, launches):
        self.launches = launches
        self.module = None  # nothing loaded on a device: nothing for CompiledKernel.__del__ to unload

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("compiled", grid, args))


class _Kernel:
    """A JIT function with parameters (x_ptr, n, BLOCK) whose launch returns ``returns(launches)``."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self, returns=_Compiled):
        self.launches = []
        self.returns = returns

    def __getitem__(self, grid):
        def run(*args, num_warps, enable_fp_fusion, **constexprs):
            self.launches.append(("jit", grid, args, constexprs, num_warps))
            return self.returns(self.launches)
        return run


def _routes(kernel):
    return [launch[0] for launch in kernel.launches]


def _at(residue: int, dtype=torch.float32) -> torch.Tensor:
    """64 elements whose address is ``residue`` bytes past a multiple of 256 (CPU allocations align to less)."""
    buffer = torch.zeros(1024, dtype=torch.uint8)
    start = (residue - buffer.data_ptr()) % 256
    return buffer[start:start + 64 * dtype.itemsize].view(dtype)


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(launcher, "_plans", {})
    monkeypatch.setattr(launcher, "ENABLED", True)


def _launch(kernel, x, replayable=True) -> bool:
    """A launch with grid (4,), scalar n = x.numel(), BLOCK 16, 2 warps; whether a plan ran it."""
    derive = lambda: launcher.Launch((4,), (x.numel(),), {"BLOCK": 16}, 2)  # noqa: E731
    return launcher.launch(kernel, (x,), derive, {"enable_fp_fusion": True}, replayable)




def test_a_launch_is_replayed_through_the_compiled_kernel_with_every_parameter_in_order():
    kernel = _Kernel()
    _launch(kernel, _at(0))
    other_x = _at(16)  # Triton specializes on 16-byte alignment, no finer
    assert _launch(kernel, other_x)
    assert _routes(kernel) == ["jit", "compiled"]
    assert kernel.launches[1] == ("compiled", (4, 1, 1), (other_x, 64, 16))


def test_the_jit_fallback_binds_the_same_arguments_as_the_replay():
    """What the replayed launcher receives positionally is what the JIT received, bound by name."""
    kernel, x = _Kernel(), _at(0)
    _launch(kernel, x)
    launcher.ENABLED = False
    assert not _launch(kernel, x)
    (_, _, jit_args, constexprs, _), (_, _, again, _, _) = kernel.launches
    launcher.ENABLED = True
    _launch(kernel, x)
    bound = dict(zip(_Kernel.arg_names, jit_args)) | constexprs
    assert dict(zip(_Kernel.arg_names, kernel.launches[2][2])) == bound and again == jit_args


@pytest.mark.parametrize("other", [
    lambda: _at(4),  # 4 bytes past a 16-byte boundary
    lambda: _at(0, torch.float64),
    lambda: _at(0)[:32],  # another shape: other integer arguments
    lambda: _at(0).view(8, 8),
], ids=["misaligned", "dtype", "length", "shape"])
def test_a_tensor_triton_or_the_launch_could_treat_differently_is_not_replayed(other):
    kernel = _Kernel()
    _launch(kernel, _at(0))
    assert not _launch(kernel, other())
    assert _routes(kernel) == ["jit", "jit"]


def test_another_kernel_is_not_replayed_by_this_ones_plan():
    kernel, other_kernel, x = _Kernel(), _Kernel(), _at(0)
    _launch(kernel, x)
    assert not _launch(other_kernel, x)


def test_no_plan_is_left_without_a_compiled_kernel_or_when_not_to_be_remembered():
    """Under the interpreter a launch compiles nothing; launches with a tuning config are not the default's."""
    interpreted, tuned, x = _Kernel(returns=lambda launches: None), _Kernel(), _at(0)
    _launch(interpreted, x)
    _launch(tuned, x, replayable=False)
    assert not _launch(interpreted, x) and not _launch(tuned, x, replayable=False)
    assert _routes(interpreted) == _routes(tuned) == ["jit", "jit"]


def test_a_compiled_kernel_without_the_expected_launcher_leaves_no_plan_and_stops_replays():
    class NoLauncher(_Compiled):
        def __getitem__(self, grid):
            raise AttributeError("no launcher here")

    kernel, x = _Kernel(returns=NoLauncher), _at(0)
    _launch(kernel, x)
    assert not launcher.ENABLED and launcher._plans == {}
    assert not _launch(kernel, x)


def test_a_launcher_whose_calling_convention_changed_falls_back_to_the_jit():
    class ChangedLauncher(_Compiled):
        def __getitem__(self, grid):
            def run(*args):
                raise TypeError("run() takes 3 positional arguments")
            return run

    kernel, x = _Kernel(returns=ChangedLauncher), _at(0)
    _launch(kernel, x)
    assert not _launch(kernel, x)  # the plan raised before launching: the JIT launched instead
    assert not launcher.ENABLED and launcher._plans == {}
    _launch(kernel, x)
    assert _routes(kernel) == ["jit", "jit", "jit"] and launcher._plans == {}


def test_replays_switched_off_launch_through_the_jit_every_time():
    kernel, x = _Kernel(), _at(0)
    launcher.ENABLED = False
    _launch(kernel, x)
    assert not _launch(kernel, x) and launcher._plans == {}
    assert _routes(kernel) == ["jit", "jit"]

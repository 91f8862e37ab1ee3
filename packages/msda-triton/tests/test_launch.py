"""backend._launch: Triton's compiled kernel is reused only for arguments that Triton would specialize alike.

Stand-ins replace the JIT function and its CompiledKernel, so this runs without a GPU or the interpreter;
the GPU suite runs the real kernels through the same path (test_gpu.py also mixes aligned and misaligned
inputs of one shape).
"""

import pytest
import torch
from triton.compiler import CompiledKernel

from msda_triton import backend


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
        def run(*args, num_warps, **constexprs):
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


def test_the_same_key_launches_through_the_compiled_kernel_with_every_parameter_in_order():
    kernel, x = _Kernel(), _at(0)
    backend._launch(kernel, (4,), (x, 64), {"BLOCK": 16}, 2)
    other_x_same_alignment = _at(0)
    backend._launch(kernel, (4,), (other_x_same_alignment, 64), {"BLOCK": 16}, 2)
    assert _routes(kernel) == ["jit", "compiled"]
    assert kernel.launches[1] == ("compiled", (4, 1, 1), (other_x_same_alignment, 64, 16))


@pytest.mark.parametrize("change", [
    lambda x, n, c, w: (_at(4), n, c, w),  # 4 bytes past a 16-byte boundary
    lambda x, n, c, w: (_at(16), n, c, w),  # 16-byte aligned, not 256: finer than Triton's rule
    lambda x, n, c, w: (_at(0, torch.float64), n, c, w),
    lambda x, n, c, w: (x, 48, c, w),  # still divisible by 16
    lambda x, n, c, w: (x, 65, c, w),
    lambda x, n, c, w: (x, n, {"BLOCK": 32}, w),
    lambda x, n, c, w: (x, n, c, 4),
], ids=["misaligned", "aligned-16", "dtype", "integer", "integer-not-16", "constexpr", "num_warps"])
def test_any_change_triton_could_specialize_on_launches_through_triton(change):
    kernel, x = _Kernel(), _at(0)
    backend._launch(kernel, (4,), (x, 64), {"BLOCK": 16}, 2)
    x2, n2, constexprs2, warps2 = change(x, 64, {"BLOCK": 16}, 2)
    backend._launch(kernel, (4,), (x2, n2), constexprs2, warps2)
    assert _routes(kernel) == ["jit", "jit"]


def test_nothing_is_reused_when_triton_returns_no_compiled_kernel():
    """As under the interpreter, whose launches compile nothing."""
    kernel, x = _Kernel(returns=lambda launches: None), _at(0)
    for _ in range(2):
        backend._launch(kernel, (4,), (x, 64), {"BLOCK": 16}, 2)
    assert _routes(kernel) == ["jit", "jit"]

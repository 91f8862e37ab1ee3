"""Eager launches, replayed: the one use of a private Triton API (``CompiledKernel``'s launcher).

``launch`` is what every eager launch of the backend goes through. The first launch of a kernel for a key
(``key``) derives its grid and arguments and goes through Triton's JIT, which leaves a compiled kernel; its
launcher for that grid is kept as a plan. A later launch with the same key calls the plan directly, skipping
both the derivation and the JIT's per-call argument handling: a quarter of a decoder forward+backward's host
time (BENCHMARKS.md, "The decoder call from Python"). The fallback is the JIT itself: with ``ENABLED`` off,
under the interpreter (which compiles nothing), or once the private API is not what this module expects (it then
turns itself off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

try:  # the compiled kernel's own launcher: a private Triton API
    from triton.compiler import CompiledKernel
except ImportError:
    CompiledKernel = None

ENABLED = CompiledKernel is not None
_MAX_PLANS = 1024  # shapes vary with image size: the cache is bounded, cleared when full


class Launch(NamedTuple):
    """A launch derived from the tensors' metadata: ``kernel[grid](*pointers, *scalars, **constexprs,
    num_warps=num_warps, **compile_options)``."""

    grid: tuple
    scalars: tuple
    constexprs: dict
    num_warps: int


class _Plan(NamedTuple):
    """How an earlier launch ran: Triton's launcher for its grid, and the arguments after the pointers (the
    integers, then the constexprs, in the kernel's order)."""

    runner: Callable
    trailing: tuple


_plans: dict = {}  # key -> _Plan


def key(kernel, pointers: tuple) -> tuple:
    """What fixes a launch besides the pointers' addresses. Each launch site derives its integer arguments, grid,
    constexprs and num_warps from the shapes and dtypes of the tensors it passes, and Triton specializes a
    pointer on its dtype and 16-byte alignment, so: the kernel, the device, and each tensor's shape, dtype and
    address modulo 16 (None stays None)."""
    return (kernel, pointers[0].device, *(None if t is None else (t.shape, t.dtype, t.data_ptr() % 16)
                                          for t in pointers))


def launch(kernel, pointers: tuple, derive: Callable[[], Launch], compile_options: dict,
           replayable: bool = True) -> bool:
    """Launch ``kernel`` eagerly on ``pointers`` (its leading arguments) and say whether a plan ran it. Without
    a plan for their key, ``derive()`` gives the launch, which goes through the JIT and, if ``replayable`` (a
    launch derived from the tensors' metadata alone, not a tuning config), leaves a plan. It launches on the
    tensors' own device (cuda:1 works), on its current stream; the device guard is entered only to switch devices:
    entering one costs more host time than asking which device is current."""
    device = pointers[0].device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return launch(kernel, pointers, derive, compile_options, replayable)
    plan = _plans.get(key(kernel, pointers)) if ENABLED and replayable else None
    if plan is not None:
        try:
            plan.runner(*pointers, *plan.trailing)
            return True
        except TypeError:  # a launcher whose calling convention changed raises before launching
            _stop()
    grid, scalars, constexprs, num_warps = derive()
    compiled = kernel[grid](*pointers, *scalars, **constexprs, num_warps=num_warps, **compile_options)
    if ENABLED and replayable and isinstance(compiled, CompiledKernel):  # the interpreter compiles nothing
        _remember(kernel, pointers, Launch(grid, scalars, constexprs, num_warps), compiled)
    return False


def _remember(kernel, pointers: tuple, launch: Launch, compiled) -> None:
    try:
        runner = compiled[launch.grid + (1,) * (3 - len(launch.grid))]
    except Exception:  # not the launcher this module knows: launch through the JIT from now on
        _stop()
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    tail = (launch.constexprs[name] for name in kernel.arg_names[len(pointers) + len(launch.scalars):])
    _plans[key(kernel, pointers)] = _Plan(runner, (*launch.scalars, *tail))


def _stop() -> None:
    global ENABLED
    ENABLED = False
    _plans.clear()

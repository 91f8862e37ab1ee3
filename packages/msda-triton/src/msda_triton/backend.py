"""The ``triton`` backend: kernels.py behind two ``torch.library.triton_op``s, ``msda::_triton_forward`` and
``msda::_triton_backward``. While torch.compile or torch.export trace a call, the backend calls those ops and every
launch goes through ``torch.library.wrap_triton``, so Inductor and AOTInductor compile the kernels into their own
code. An eager call on real tensors runs the same bodies directly, skipping the custom op's dispatch, whose host
time a decoder-sized call feels (BENCHMARKS.md, "Host time after the op-layer rebuild"), on CUDA tensors, or on
CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 (how CI runs the real kernels without a GPU).

The bodies also run on fake tensors, so they branch on metadata only: a launch rule that depends on a size the
trace leaves symbolic takes the choice that is right for every size (launch_forward).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, NamedTuple

import torch
import triton
from torch.fx.experimental.symbolic_shapes import statically_known_true

try:  # the compiled kernel's own launcher: a private Triton API, used by _replay alone
    from triton.compiler import CompiledKernel
except ImportError:
    CompiledKernel = None

from msda_core import Backend, output_shape

from . import kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it when kernels are defined
if INTERPRETED:
    try:
        import numpy  # noqa: F401  (what Triton's interpreter computes with)
    except ImportError as err:
        raise ImportError("TRITON_INTERPRET=1: Triton's CPU interpreter needs numpy: pip install "
                          "'msda-triton[interpreter]'") from err


def accumulates_in_fp32(dtype: torch.dtype, grad_accum: str) -> bool:
    """The accumulation switch for grad_value: "auto" and "fp32" scatter fp16/bf16 gradients through an fp32
    buffer cast once at the end (each native half-precision add rounds the running sum); "native" adds in the
    gradient's own dtype. fp32 gradients are fp32 either way."""
    return dtype != torch.float32 and grad_accum != "native"


@functools.cache
def _capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, asked once: the query costs host time on every call otherwise."""
    return torch.cuda.get_device_capability(device)


def _on_device(device: torch.device):
    """Launch on the tensors' own device (cuda:1 works), on its current stream. The guard is entered only to
    switch devices: entering one costs more host time than asking which device is current."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _eager(tensor) -> bool:
    """Whether the call runs now on real tensors. Tracing (torch.compile, export) passes fake or functional
    tensors, subclasses of torch.Tensor, whose launches must be recorded through wrap_triton."""
    return type(tensor) is torch.Tensor and not torch.compiler.is_compiling()


class _Plan(NamedTuple):
    """How an earlier eager call launched a kernel: Triton's launcher for its grid, and the arguments after the
    pointers (the integers, then the constexprs, in the kernel's order)."""

    runner: Callable
    trailing: tuple


# _plan_key -> _Plan. Replaying a plan is the one place that uses a private Triton API (CompiledKernel's
# launcher); REPLAY_LAUNCHES turns it off, and it turns itself off when that API is not what it expects.
_plans: dict = {}
REPLAY_LAUNCHES = True


def _plan_key(kernel, pointers: tuple) -> tuple:
    """What fixes a launch besides the pointers' addresses. Each launch site derives its integer arguments, grid,
    constexprs and num_warps from the shapes and dtypes of the tensors it passes, and Triton specializes a
    pointer on its dtype and 16-byte alignment, so: the kernel, the device, and each tensor's shape, dtype and
    address modulo 16 (None stays None)."""
    return (kernel, pointers[0].device, *(None if t is None else (t.shape, t.dtype, t.data_ptr() % 16)
                                          for t in pointers))


def _replay(kernel, pointers: tuple) -> bool:
    """Launch ``kernel`` on ``pointers`` (its leading arguments) as the eager launch that left a plan for their
    _plan_key did, if one did, and say whether it launched. This skips deriving the launch and Triton's own
    per-call argument handling (BENCHMARKS.md, "Host time"). A launcher whose calling convention changed raises
    TypeError before launching: replays then stop for the process, and the caller launches through the JIT."""
    global REPLAY_LAUNCHES
    plan = _plans.get(_plan_key(kernel, pointers)) if REPLAY_LAUNCHES else None
    if plan is None:
        return False
    try:
        with _on_device(pointers[0].device):
            plan.runner(*pointers, *plan.trailing)
    except TypeError:
        REPLAY_LAUNCHES = False
        _plans.clear()
        return False
    return True


def _remember(kernel, grid: tuple, pointers: tuple, scalars: tuple, constexprs: dict, compiled) -> None:
    """Leave a plan for _replay from an eager launch's compiled kernel (the interpreter compiles nothing)."""
    global REPLAY_LAUNCHES
    if not REPLAY_LAUNCHES or CompiledKernel is None or not isinstance(compiled, CompiledKernel):
        return
    try:
        runner = compiled[grid + (1,) * (3 - len(grid))]
    except Exception:  # not the launcher this code knows: launch through the JIT from now on
        REPLAY_LAUNCHES = False
        return
    if len(_plans) >= 1024:  # shapes vary with image size: bound the cache, don't grow forever
        _plans.clear()
    tail = (constexprs[name] for name in kernel.arg_names[len(pointers) + len(scalars):])
    _plans[_plan_key(kernel, pointers)] = _Plan(runner, (*scalars, *tail))


def _launch(kernel, grid: tuple, pointers: tuple, scalars: tuple, constexprs: dict, num_warps: int,
            remember: bool = True) -> None:
    """``kernel[grid](*pointers, *scalars, **constexprs, num_warps=num_warps)``: traced, through wrap_triton, which
    records the launch for Inductor to compile with its own options; eagerly, _launch_now runs it."""
    if _eager(pointers[0]):
        _launch_now(kernel, grid, pointers, scalars, constexprs, num_warps, remember)
    else:
        torch.library.wrap_triton(kernel)[grid](*pointers, *scalars, **constexprs, num_warps=num_warps)


def _launch_now(kernel, grid: tuple, pointers: tuple, scalars: tuple, constexprs: dict, num_warps: int,
                remember: bool) -> None:
    """An eager launch on the tensors' device with kernels.COMPILE_OPTIONS, leaving a plan for _replay when
    ``remember``."""
    with _on_device(pointers[0].device):
        compiled = kernel[grid](*pointers, *scalars, **constexprs, num_warps=num_warps, **kernels.COMPILE_OPTIONS)
    if remember:
        _remember(kernel, grid, pointers, scalars, constexprs, compiled)


def _sizes(value, sampling_locations):
    B, S, M, D = value.shape
    Q, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    return B * Q * M, Q, S, M, D, L, P


def needs_int64_offsets(*tensors) -> bool:
    """int32 offsets are exact while every tensor has fewer than 2^30 elements: a partial last block's masked
    rows reach a little past a tensor's end, still far from 2^31. A size the trace leaves symbolic may be any,
    so it takes int64."""
    return not all(statically_known_true(t.numel() < 2 ** 30) for t in tensors)


def launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out,
                   config=None):
    """Run forward_kernel on contiguous tensors into ``out``; ``config`` overrides kernels.launch_config (and
    the offsets' width, if it names WIDE). Symbolic rows take the many-rows rule, right at every size."""
    pointers = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out)
    if config is None and _eager(value) and _replay(kernels.forward_kernel, pointers):
        return
    sizes = _sizes(value, sampling_locations)
    n_rows, Q, _, M, D = sizes[:5]
    few_rows = statically_known_true(n_rows < kernels.FEW_ROWS)
    blocks, num_warps = config or kernels.launch_config(D, backward=False, value_fp32=value.dtype == torch.float32,
                                                        few_rows=few_rows)
    block_r = blocks["BLOCK_R"]
    row_blocks = triton.cdiv(Q, block_r) * value.shape[0] * M if blocks["HEAD_MAJOR"] else triton.cdiv(n_rows, block_r)
    _launch(kernels.forward_kernel, (row_blocks, triton.cdiv(D, blocks["BLOCK_D"])), pointers, sizes,
            {"WIDE": needs_int64_offsets(value, sampling_locations, out), **blocks}, num_warps,
            remember=config is None)


def fixed_point_maxima(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights):
    """What the deterministic mode's scales derive from (kernels._fixed_point_scales), as device scalars with
    no host sync: max|a|, max|g| and the largest anchored mass of kernels.anchor_mass_kernel."""
    weight_max = torch.linalg.vector_norm(attention_weights, float("inf"))
    grad_max = torch.linalg.vector_norm(grad_output, float("inf"))
    mass = torch.zeros(value.shape[:3], dtype=torch.int64, device=value.device)
    pointers = (spatial_shapes, level_start_index, sampling_locations, attention_weights, weight_max, mass)
    if not (_eager(value) and _replay(kernels.anchor_mass_kernel, pointers)):
        n_rows, Q, S, M, D, L, P = _sizes(value, sampling_locations)
        blocks, num_warps = kernels.ANCHOR_MASS_LAUNCH
        _launch(kernels.anchor_mass_kernel, (triton.cdiv(n_rows, blocks["BLOCK_R"]),), pointers,
                (n_rows, Q, S, M, L, P), blocks, num_warps)
    return weight_max, grad_max, mass.amax()


def launch_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    grad_value, grad_locations, grad_weights, fixed_point=None, config=None):
    """Run backward_kernel on contiguous tensors; grad_value must be zeroed (it is accumulated into).
    With ``fixed_point`` = (fraction, maxima): the deterministic mode, grad_value and fraction fp32 and zeroed,
    maxima from fixed_point_maxima."""
    fraction, maxima = fixed_point or (None, (None, None, None))
    pointers = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output,
                grad_value, fraction, grad_locations, grad_weights, *maxima)
    if config is None and _eager(value) and _replay(kernels.backward_kernel, pointers):
        return
    sizes = _sizes(value, sampling_locations)
    blocks, num_warps = config or kernels.launch_config(
        sizes[4], backward=True, half_atomics=grad_value.dtype != torch.float32)
    _launch(kernels.backward_kernel, (triton.cdiv(sizes[0], blocks["BLOCK_R"]),), pointers, sizes,
            {**blocks, "FIXED_POINT": fixed_point is not None}, num_warps, remember=config is None)


def _forward(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
            sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> torch.Tensor:
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        t.contiguous() for t in (value, spatial_shapes, level_start_index, sampling_locations, attention_weights))
    out = value.new_empty(output_shape(value, sampling_locations))
    launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out)
    return out


def _backward(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
             level_start_index: torch.Tensor, sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
             grad_accum: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """deterministic: grad_value as exact sums of integers in two fp32 buffers (grad_accum does not apply),
    bitwise reproducible; kernels._fixed_point_scales says why the sums are exact."""
    grad_output, *inputs = (t.contiguous() for t in (grad_output, value, spatial_shapes, level_start_index,
                                                     sampling_locations, attention_weights))
    value, sampling_locations, attention_weights = inputs[0], inputs[3], inputs[4]
    fp32 = deterministic or accumulates_in_fp32(value.dtype, grad_accum)
    grad_value = torch.zeros(value.shape, dtype=torch.float32 if fp32 else value.dtype, device=value.device)
    grad_locations = torch.empty_like(sampling_locations)
    grad_weights = torch.empty_like(attention_weights)
    if not deterministic:
        launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights)
        return grad_value.to(value.dtype), grad_locations, grad_weights
    fraction, maxima = torch.zeros_like(grad_value), fixed_point_maxima(grad_output, *inputs)
    launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights, (fraction, maxima))
    out = grad_value if value.dtype == torch.float32 else torch.empty_like(value)  # in place: no third buffer
    pointers = (grad_value, fraction, *maxima, out)
    if not (_eager(value) and _replay(kernels.fixed_point_finish_kernel, pointers)):
        blocks, num_warps = kernels.FIXED_POINT_FINISH_LAUNCH
        _launch(kernels.fixed_point_finish_kernel, (triton.cdiv(value.numel(), blocks["BLOCK"]),), pointers,
                (value.numel(),), blocks, num_warps)
    return out, grad_locations, grad_weights


_triton_forward = torch.library.triton_op("msda::_triton_forward", _forward, mutates_args=())
_triton_backward = torch.library.triton_op("msda::_triton_backward", _backward, mutates_args=())


@_triton_forward.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Shapes only: torch.compile and export learn the output without running the body (its launches)."""
    return value.new_empty(output_shape(value, sampling_locations))


@_triton_backward.register_fake
def _(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_accum,
      deterministic):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """The output, from the body directly when eager, else through the triton_op that tracing records."""
    run = _forward if _eager(value) else _triton_forward
    return run(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             grad_accum, deterministic):
    """The three gradients, as forward: the body directly when eager, else the triton_op."""
    run = _backward if _eager(value) else _triton_backward
    return run(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
               grad_accum, deterministic)


def _limits(inputs) -> list:
    if inputs.device.type == "cuda" and _capability(inputs.device) < (8, 0):
        return [f"needs compute capability 8.0+, {inputs.device} has {'.'.join(map(str, _capability(inputs.device)))}"]
    terms = inputs.queries * inputs.levels * inputs.points  # the most an element of grad_value receives
    if inputs.deterministic and terms >= kernels.MAX_EXACT_TERMS.value:
        return [f"the deterministic mode's exact fp32 sums need Q*L*P < 2^23 terms per element, got {terms}"]
    if INTERPRETED and inputs.value_dtype == torch.bfloat16 and inputs.grad_accum == "native":
        return ["Triton's interpreter has no bf16 atomic add: use grad_accum='fp32' or 'auto' on CPU"]
    return []


BACKEND = Backend(
    name="triton",
    forward=forward,
    backward=backward,
    devices=frozenset({"cuda", "cpu"} if INTERPRETED else {"cuda"}),
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    auto_devices=frozenset({"cuda"}),  # on CPU the interpreter is for testing, never chosen by auto
    priority=100,
    traceable=True,
    honors_grad_accum=True,  # grad_value is scattered with atomic adds: reproducible on no device,
    deterministic_on_request=True,  # except in the fixed-point mode
    limits=_limits,
)

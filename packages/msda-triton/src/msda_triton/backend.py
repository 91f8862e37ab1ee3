"""The ``triton`` backend: kernels.py launched on CUDA tensors, or on CPU tensors through Triton's
interpreter when TRITON_INTERPRET=1 (how CI runs the real kernels without a GPU)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
from triton.compiler import CompiledKernel

from msda_core import Backend

from . import kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it when kernels are defined


def accumulates_in_fp32(dtype: torch.dtype, device: torch.device, grad_accum: str) -> bool:
    """The accumulation switch for grad_value: "auto" scatters bf16 through an fp32 buffer unless the
    device has native bf16 atomic adds (compute capability 9.0+); elsewhere they are a CAS loop."""
    if grad_accum != "auto":
        return grad_accum == "fp32"
    native_bf16 = device.type == "cuda" and _capability(device) >= (9, 0)
    return dtype == torch.bfloat16 and not native_bf16


@functools.cache
def _capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, asked once: the query costs host time on every backward otherwise."""
    return torch.cuda.get_device_capability(device)


def _on_device(device: torch.device):
    """Launch on the tensors' own device (cuda:1 works), on its current stream. The guard is entered only to
    switch devices: entering one costs more host time than asking which device is current."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# (kernel, num_warps, constexprs, each argument's key) -> the CompiledKernel Triton launched for it; see _launch.
_compiled: dict = {}


def _launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps)``, reusing the CompiledKernel that Triton returned
    for an earlier call with the same key. Triton's own launch re-derives every argument's specialization on
    each call, which for the decoder costs more host time than the rest of the call (BENCHMARKS.md). The key is
    finer than what Triton specializes on (each tensor's dtype and 16-byte alignment, each integer's width and
    divisibility by 16): each tensor's dtype, device and address modulo 256, each integer's value, the
    constexprs and num_warps. So a kernel is reused only where Triton would choose the same one. The
    interpreter compiles nothing, so there it is Triton's launch every time."""
    key = (kernel, num_warps, tuple(constexprs.items()), tuple(
        (a.dtype, a.device, a.data_ptr() % 256) if isinstance(a, torch.Tensor) else a for a in args))
    compiled = _compiled.get(key)
    with _on_device(args[0].device):  # every argument is on one device
        if compiled is None:
            compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)
            if isinstance(compiled, CompiledKernel):
                if len(_compiled) >= 1024:  # shapes vary with image size: bound the cache, don't grow forever
                    _compiled.clear()
                _compiled[key] = compiled
            return
        # the launcher takes every parameter in the kernel's order; the constexprs are the trailing ones
        compiled[grid + (1,) * (3 - len(grid))](*args, *(constexprs[name] for name in kernel.arg_names[len(args):]))


def _sizes(value, sampling_locations):
    B, S, M, D = value.shape
    Q, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    return B * Q * M, Q, S, M, D, L, P


def launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out,
                   config=None):
    """Run forward_kernel on contiguous tensors into ``out``; ``config`` overrides kernels.launch_config (and
    the offsets' width, if it names WIDE)."""
    sizes = _sizes(value, sampling_locations)
    n_rows, Q, _, M, D = sizes[:5]
    blocks, num_warps = config or kernels.launch_config(D, backward=False, value_fp32=value.dtype == torch.float32,
                                                        rows=n_rows)
    block_r = blocks["BLOCK_R"]
    row_blocks = triton.cdiv(Q, block_r) * value.shape[0] * M if blocks["HEAD_MAJOR"] else triton.cdiv(n_rows, block_r)
    _launch(kernels.forward_kernel, (row_blocks, triton.cdiv(D, blocks["BLOCK_D"])),
            (value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out, *sizes),
            {"WIDE": needs_int64_offsets(value, sampling_locations, out), **blocks}, num_warps)


def needs_int64_offsets(*tensors) -> bool:
    """int32 offsets are exact while every tensor has fewer than 2^30 elements: a partial last block's masked
    rows reach a little past a tensor's end, still far from 2^31. (int32 made the fp32 forward 1.27x faster at
    4 warps; BENCHMARKS.md.)"""
    return max(t.numel() for t in tensors) >= 2 ** 30


def fixed_point_maxima(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights):
    """What the deterministic mode's scales derive from (kernels._fixed_point_scales), as device scalars with
    no host sync: max|a|, max|g| and the largest anchored mass of kernels.anchor_mass_kernel."""
    weight_max = torch.linalg.vector_norm(attention_weights, float("inf"))
    grad_max = torch.linalg.vector_norm(grad_output, float("inf"))
    n_rows, Q, S, M, D, L, P = _sizes(value, sampling_locations)
    mass = torch.zeros(value.shape[:3], dtype=torch.int64, device=value.device)
    blocks, num_warps = kernels.ANCHOR_MASS_LAUNCH
    _launch(kernels.anchor_mass_kernel, (triton.cdiv(n_rows, blocks["BLOCK_R"]),),
            (spatial_shapes, level_start_index, sampling_locations, attention_weights, weight_max, mass,
             n_rows, Q, S, M, L, P), blocks, num_warps)
    return weight_max, grad_max, mass.amax()


def launch_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    grad_value, grad_locations, grad_weights, fixed_point=None, config=None):
    """Run backward_kernel on contiguous tensors; grad_value must be zeroed (it is accumulated into).
    With ``fixed_point`` = (fraction, maxima): the deterministic mode, grad_value and fraction fp32 and zeroed,
    maxima from fixed_point_maxima."""
    sizes = _sizes(value, sampling_locations)
    blocks, num_warps = config or kernels.launch_config(
        sizes[4], backward=True, half_atomics=grad_value.dtype != torch.float32)
    fraction, maxima = fixed_point or (None, (None, None, None))
    _launch(kernels.backward_kernel, (triton.cdiv(sizes[0], blocks["BLOCK_R"]),),
            (value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output,
             grad_value, fraction, grad_locations, grad_weights, *maxima, *sizes),
            {**blocks, "FIXED_POINT": fixed_point is not None}, num_warps)


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        t.contiguous() for t in (value, spatial_shapes, level_start_index, sampling_locations, attention_weights))
    B, Q = sampling_locations.shape[:2]
    out = value.new_empty(B, Q, value.shape[2] * value.shape[3])
    launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out)
    return out


def backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             grad_accum, deterministic):
    """deterministic: grad_value as exact sums of integers in two fp32 buffers (grad_accum does not apply),
    bitwise reproducible; kernels._fixed_point_scales says why the sums are exact."""
    grad_output, *inputs = (t.contiguous() for t in (grad_output, value, spatial_shapes, level_start_index,
                                                     sampling_locations, attention_weights))
    value, sampling_locations, attention_weights = inputs[0], inputs[3], inputs[4]
    fp32 = deterministic or accumulates_in_fp32(value.dtype, value.device, grad_accum)
    grad_value = torch.zeros(value.shape, dtype=torch.float32 if fp32 else value.dtype, device=value.device)
    grad_locations = torch.empty_like(sampling_locations)
    grad_weights = torch.empty_like(attention_weights)
    if not deterministic:
        launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights)
        return grad_value.to(value.dtype), grad_locations, grad_weights
    fraction, maxima = torch.zeros_like(grad_value), fixed_point_maxima(grad_output, *inputs)
    launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights, (fraction, maxima))
    out = grad_value if value.dtype == torch.float32 else torch.empty_like(value)  # in place: no third buffer
    blocks, num_warps = kernels.FIXED_POINT_FINISH_LAUNCH
    _launch(kernels.fixed_point_finish_kernel, (triton.cdiv(value.numel(), blocks["BLOCK"]),),
            (grad_value, fraction, *maxima, out, value.numel()), blocks, num_warps)
    return out, grad_locations, grad_weights


def _limits(inputs) -> list:
    if inputs.device.type == "cuda" and _capability(inputs.device) < (8, 0):
        return [f"needs compute capability 8.0+, {inputs.device} has {'.'.join(map(str, _capability(inputs.device)))}"]
    terms = inputs.queries * inputs.levels * inputs.points  # the most an element of grad_value receives
    if inputs.deterministic and terms >= 2 ** 23:
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
    accumulation_switch=True,  # grad_value is scattered with atomic adds: deterministic on no device,
    deterministic_mode=True,  # except in the fixed-point mode, on request
    limits=_limits,
)

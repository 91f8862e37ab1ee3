"""The ``triton`` backend: kernels.py launched on CUDA tensors, or on CPU tensors through Triton's
interpreter when TRITON_INTERPRET=1 (how CI runs the real kernels without a GPU)."""

from __future__ import annotations

import contextlib
import os

import torch
import triton

from msda_core import Backend

from . import kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it when kernels are defined


def accumulates_in_fp32(dtype: torch.dtype, device: torch.device, grad_accum: str) -> bool:
    """The accumulation switch for grad_value: "auto" scatters bf16 through an fp32 buffer unless the
    device has native bf16 atomic adds (compute capability 9.0+); elsewhere they are a CAS loop."""
    if grad_accum != "auto":
        return grad_accum == "fp32"
    native_bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    return dtype == torch.bfloat16 and not native_bf16


def _on_device(t: torch.Tensor):
    """Launch on the tensors' own device (cuda:1 works), on its current stream."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _sizes(value, sampling_locations):
    B, S, M, D = value.shape
    Q, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    return B * Q * M, Q, S, M, D, L, P


def launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out,
                   config=None):
    """Run forward_kernel on contiguous tensors into ``out``; ``config`` overrides kernels.launch_config."""
    sizes = _sizes(value, sampling_locations)
    n_rows, D = sizes[0], sizes[4]
    block_r, block_d, num_warps = config or kernels.launch_config(D, backward=False)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(D, block_d))
    with _on_device(value):
        kernels.forward_kernel[grid](value, spatial_shapes, level_start_index, sampling_locations,
                                     attention_weights, out, *sizes, BLOCK_R=block_r, BLOCK_D=block_d,
                                     num_warps=num_warps)


def fixed_point_scale(grad_output, attention_weights, samples_per_head: int) -> torch.Tensor:
    """The deterministic mode's scale, computed on the device (no sync): FIXED_POINT_LIMIT / bound, where
    bound = Q*L*P * max|a| * max|g| is at least any grad_value element's |sum| (a sample adds at most
    |a| * |g| to one element: its 4 corners are distinct pixels). Capped at 2^126 to stay an fp32; 1 when
    the bound is 0; 0 when it is not finite, which makes every element of grad_value NaN."""
    bound = samples_per_head * attention_weights.abs().amax().double() * grad_output.abs().amax().double()
    scale = (kernels.FIXED_POINT_LIMIT.value / bound).clamp(max=2.0 ** 126)
    scale = torch.where(bound > 0, scale, 1.0)
    return torch.where(torch.isfinite(bound), scale, 0.0).float().reshape(1)


def launch_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    grad_value, grad_locations, grad_weights, scale=None, config=None):
    """Run backward_kernel on contiguous tensors; grad_value must be zeroed (it is accumulated into).
    With ``scale`` (fixed_point_scale), grad_value is int64 and accumulated in fixed point."""
    sizes = _sizes(value, sampling_locations)
    n_rows, D = sizes[0], sizes[4]
    block_r, block_d, num_warps = config or kernels.launch_config(D, backward=True)
    with _on_device(value):
        kernels.backward_kernel[(triton.cdiv(n_rows, block_r),)](
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output,
            grad_value, grad_locations, grad_weights, scale, *sizes, BLOCK_R=block_r, BLOCK_D=block_d,
            FIXED_POINT=scale is not None, num_warps=num_warps)


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        t.contiguous() for t in (value, spatial_shapes, level_start_index, sampling_locations, attention_weights))
    B, Q = sampling_locations.shape[:2]
    out = value.new_empty(B, Q, value.shape[2] * value.shape[3])
    launch_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, out)
    return out


def backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             grad_accum, deterministic):
    """deterministic: grad_value in int64 fixed point (grad_accum does not apply), bitwise reproducible."""
    grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        t.contiguous() for t in (grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights))
    if deterministic:
        Q, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
        scale = fixed_point_scale(grad_output, attention_weights, Q * L * P)
        accumulator = torch.int64
    else:
        scale = None
        accumulator = torch.float32 if accumulates_in_fp32(value.dtype, value.device, grad_accum) else value.dtype
    grad_value = torch.zeros(value.shape, dtype=accumulator, device=value.device)
    grad_locations = torch.empty_like(sampling_locations)
    grad_weights = torch.empty_like(attention_weights)
    launch_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    grad_value, grad_locations, grad_weights, scale)
    if deterministic:
        grad_value = grad_value / scale  # int64 / fp32 -> fp32, one rounding; 0/0 = NaN when scale is 0
    return grad_value.to(value.dtype), grad_locations, grad_weights


def _limits(inputs) -> list:
    if inputs.device.type == "cuda" and torch.cuda.get_device_capability(inputs.device) < (8, 0):
        return [f"needs compute capability 8.0+, {inputs.device} has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(inputs.device)))}"]
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

"""The torch.library registration of ``msda::deform_attn`` and its backward op.

The forward op and a separate backward op are both opaque to autograd and to tracing; autograd is
registered on the forward and calls the backward op, so each backend supplies its own backward kernel and
nothing that reads the values of ``spatial_shapes`` runs outside an op (fake tensors have none).
"""

from __future__ import annotations

import torch

from . import registry
from .validation import check_grad_accum, check_inputs, derived_level_start_index

# The schemas, also read by msda_testkit.overhead to build a kernel-less op pair of the same shape.
SCHEMA = ("(Tensor value, Tensor spatial_shapes, Tensor? level_start_index, Tensor sampling_locations, "
          "Tensor attention_weights, *, str backend='auto', str grad_accum='auto', bool? deterministic=None) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor? level_start_index, "
                   "Tensor sampling_locations, Tensor attention_weights, *, str backend, str grad_accum, "
                   "bool? deterministic=None) -> (Tensor, Tensor, Tensor)")
torch.library.define("msda::deform_attn", SCHEMA)
torch.library.define("msda::deform_attn_backward", BACKWARD_SCHEMA)


def _output_shape(value, sampling_locations):
    B, Q = sampling_locations.shape[:2]
    return (B, Q, value.shape[2] * value.shape[3])


def _is_empty(value, sampling_locations) -> bool:
    """B, Q, M, D or P of zero: the sum has no terms, so the result is zeros and no kernel runs."""
    return value.numel() == 0 or sampling_locations.numel() == 0


def _prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, grad_accum,
             deterministic=False):
    """Validate, pick the backend, and derive level_start_index; shared by the forward and backward ops."""
    check_grad_accum(grad_accum)
    check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    inputs = registry.Inputs.of(value, sampling_locations, grad_accum, deterministic)
    chosen = registry.resolve(registry.requested(backend), inputs)
    if level_start_index is None:  # the one validation derived when it read spatial_shapes, if any
        level_start_index = derived_level_start_index(value.shape[1], spatial_shapes)
    if level_start_index is None:  # on the device: no host sync, so it also works inside graph capture
        sizes = spatial_shapes.to(torch.int64).prod(1)
        level_start_index = sizes.cumsum(0) - sizes
    return chosen, level_start_index


@torch.library.impl("msda::deform_attn", "default")
def _deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                 backend="auto", grad_accum="auto", deterministic=None):
    # the forward of every backend is deterministic; the flag matters to the backward only
    chosen, level_start_index = _prepare(value, spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights, backend, grad_accum)
    if _is_empty(value, sampling_locations):
        return value.new_zeros(_output_shape(value, sampling_locations))
    return chosen.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


@torch.library.register_fake("msda::deform_attn")
def _deform_attn_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                      backend="auto", grad_accum="auto", deterministic=None):
    check_grad_accum(grad_accum)
    check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return value.new_empty(_output_shape(value, sampling_locations))


@torch.library.impl("msda::deform_attn_backward", "default")
def _deform_attn_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, *, backend, grad_accum, deterministic=None):
    if deterministic is None:  # as torch's own ops: follow torch.use_deterministic_algorithms
        deterministic = torch.are_deterministic_algorithms_enabled()
    chosen, level_start_index = _prepare(value, spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights, backend, grad_accum, deterministic)
    _check_grad_output(grad_output, value, sampling_locations)
    if _is_empty(value, sampling_locations):
        return torch.zeros_like(value), torch.zeros_like(sampling_locations), torch.zeros_like(attention_weights)
    return chosen.backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, grad_accum, deterministic)


@torch.library.register_fake("msda::deform_attn_backward")
def _deform_attn_backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, *, backend, grad_accum, deterministic=None):
    check_grad_accum(grad_accum)
    check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    _check_grad_output(grad_output, value, sampling_locations)
    return (value.new_empty(value.shape), sampling_locations.new_empty(sampling_locations.shape),
            attention_weights.new_empty(attention_weights.shape))


def _check_grad_output(grad_output, value, sampling_locations):
    expected = _output_shape(value, sampling_locations)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output: expected shape (B, Q, M*D) = {expected}, got {tuple(grad_output.shape)}")
    if grad_output.device != value.device:
        raise ValueError(f"grad_output: expected device {value.device} (the device of value), got {grad_output.device}")
    if not grad_output.is_floating_point():
        raise TypeError(f"grad_output: expected a floating dtype, got {grad_output.dtype}")


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = inputs
    # Fix the request now, so a use_backend() scope left before .backward() still applies to it.
    ctx.backend = registry.requested(keyword_only_inputs["backend"])
    ctx.grad_accum = keyword_only_inputs["grad_accum"]
    ctx.deterministic = keyword_only_inputs["deterministic"]
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def _backward(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_locations, grad_weights = torch.ops.msda.deform_attn_backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        backend=ctx.backend, grad_accum=ctx.grad_accum, deterministic=ctx.deterministic,
    )
    return grad_value, None, None, grad_locations, grad_weights


def _double_backward(ctx, *grads):
    raise NotImplementedError(
        "msda.deform_attn: double backward (differentiating the gradients again) is not supported by any backend"
    )


def _no_context(ctx, inputs, keyword_only_inputs, output):
    pass


torch.library.register_autograd("msda::deform_attn", _backward, setup_context=_setup_context)
torch.library.register_autograd("msda::deform_attn_backward", _double_backward, setup_context=_no_context)


def deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                backend: str = "auto", grad_accum: str = "auto", deterministic: bool | None = None) -> torch.Tensor:
    """Multi-scale deformable attention; returns (B, Q, M*D) in value's dtype. See the README for the math."""
    return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, backend=backend, grad_accum=grad_accum,
                                      deterministic=deterministic)

"""The torch.library registration of ``msda::deform_attn`` and its backward op.

The forward op and a separate backward op are both opaque to autograd and to tracing; autograd is
registered on the forward and calls the backward op, so each backend supplies its own backward kernel and
nothing that reads the values of ``spatial_shapes`` runs outside an op (fake tensors have none).
"""

from __future__ import annotations

import torch

from . import registry
from .validation import check_grad_accum, check_inputs

# The schemas, also read by msda_testkit.overhead to build a kernel-less op pair of the same shape.
SCHEMA = ("(Tensor value, Tensor spatial_shapes, Tensor? level_start_index, Tensor sampling_locations, "
          "Tensor attention_weights, *, str backend='auto', str grad_accum='auto', bool? deterministic=None) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor? level_start_index, "
                   "Tensor sampling_locations, Tensor attention_weights, *, str backend, str grad_accum, "
                   "bool? deterministic=None) -> (Tensor, Tensor, Tensor)")
torch.library.define("msda::deform_attn", SCHEMA)
torch.library.define("msda::deform_attn_backward", BACKWARD_SCHEMA)


def output_shape(value, sampling_locations) -> tuple:
    """The op's (B, Q, M*D): for backends and tools that allocate the output themselves."""
    B, Q = sampling_locations.shape[:2]
    return (B, Q, value.shape[2] * value.shape[3])


def _is_empty(value, sampling_locations) -> bool:
    """B, Q, M, D or P of zero: the sum has no terms, so the result is zeros and no kernel runs."""
    return value.numel() == 0 or sampling_locations.numel() == 0


def _prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, grad_accum,
             deterministic=False):
    """Validate, pick the backend, and derive level_start_index; shared by the forward and backward ops."""
    check_grad_accum(grad_accum)
    level_start_index = check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    inputs = registry.Inputs.of(value, sampling_locations, grad_accum, deterministic)
    chosen = registry.resolve(registry.requested(backend), inputs)
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
        return value.new_zeros(output_shape(value, sampling_locations))
    return chosen.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


@torch.library.register_fake("msda::deform_attn")
def _deform_attn_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                      backend="auto", grad_accum="auto", deterministic=None):
    check_grad_accum(grad_accum)
    check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return value.new_empty(output_shape(value, sampling_locations))


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
    expected = output_shape(value, sampling_locations)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output: expected shape (B, Q, M*D) = {expected}, got {tuple(grad_output.shape)}")
    if grad_output.device != value.device:
        raise ValueError(f"grad_output: expected device {value.device} (the device of value), got {grad_output.device}")
    if not grad_output.is_floating_point():
        raise TypeError(f"grad_output: expected a floating dtype, got {grad_output.dtype}")


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_LIBRARY = torch.library.Library("msda", "FRAGMENT")  # holds the autograd registrations for the process's life


def _below_autograd(op, keyset, *args, **options):
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **options)


def register_autograd(lib: torch.library.Library, name: str) -> None:
    """Register the autograd of ``lib``'s op pair ``name`` / ``name``_backward, defined with SCHEMA and
    BACKWARD_SCHEMA: the forward's gradients come from the backward op; differentiating the backward op raises.

    torch.library.register_autograd generates the same structure: on the Autograd key, an autograd.Function
    whose forward redispatches below autograd (so fake tensors and tracing see the op, not its kernels). Its
    generated kernel also re-adds the schema's defaults, checks the op's tags and wraps its arguments on every
    call: with kernels that only allocate, its forward took 24 us on the CPU dev machine against 11 us with these,
    which do only what the pair needs (BENCHMARKS.md). msda_testkit.overhead builds its kernel-less pair with this
    too."""
    ops = getattr(torch.ops, lib.ns)
    forward_op, backward_op = getattr(ops, name).default, getattr(ops, name + "_backward").default

    def forward(ctx, keyset, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                backend, grad_accum, deterministic):
        # Fix the request now, so a use_backend() scope left before .backward() still applies to it.
        ctx.options = {"backend": registry.requested(backend), "grad_accum": grad_accum, "deterministic": deterministic}
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        return _below_autograd(forward_op, keyset, value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, backend=backend, grad_accum=grad_accum, deterministic=deterministic)

    def backward(ctx, grad_output):
        grad_value, grad_locations, grad_weights = backward_op(grad_output, *ctx.saved_tensors, **ctx.options)
        return None, grad_value, None, None, grad_locations, grad_weights, None, None, None

    def backward_op_forward(ctx, keyset, options, *tensors):
        return _below_autograd(backward_op, keyset, *tensors, **options)

    def double_backward(ctx, *grads):
        raise NotImplementedError(
            f"{lib.ns}.{name}: double backward (differentiating the gradients again) is not supported by any backend")

    # Named after the ops, so a grad_fn reads msda_deform_attnBackward.
    function = type(f"{lib.ns}_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    backward_function = type(f"{lib.ns}_{name}_backward", (torch.autograd.Function,),
                             {"forward": staticmethod(backward_op_forward), "backward": staticmethod(double_backward)})

    def forward_autograd(keyset, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                         backend="auto", grad_accum="auto", deterministic=None):
        if torch.is_grad_enabled() and (value.requires_grad or sampling_locations.requires_grad
                                        or attention_weights.requires_grad):
            return function.apply(keyset, value, spatial_shapes, level_start_index, sampling_locations,
                                  attention_weights, backend, grad_accum, deterministic)
        return _below_autograd(forward_op, keyset, value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, backend=backend, grad_accum=grad_accum, deterministic=deterministic)

    def backward_autograd(keyset, *tensors, **options):
        """Runs the backward; a graph through it (create_graph=True) raises only if it is differentiated again."""
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return backward_function.apply(keyset, options, *tensors)
        return _below_autograd(backward_op, keyset, *tensors, **options)

    lib.impl(name, forward_autograd, "Autograd", with_keyset=True)
    lib.impl(name + "_backward", backward_autograd, "Autograd", with_keyset=True)


register_autograd(_LIBRARY, "deform_attn")


def deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                backend: str = "auto", grad_accum: str = "auto", deterministic: bool | None = None) -> torch.Tensor:
    """Multi-scale deformable attention; returns (B, Q, M*D) in value's dtype. See the README for the math."""
    return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, backend=backend, grad_accum=grad_accum,
                                      deterministic=deterministic)

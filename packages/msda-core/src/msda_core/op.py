"""The torch.library registration of ``msda::deform_attn`` and ``msda::deform_attn_backward``.

Both public ops are CompositeImplicitAutograd: their kernel, the router, validates the inputs, chooses a backend
from metadata alone, and runs it. Gradients come from :class:`DeformAttn`, an autograd.Function whose backward
runs the same backend's backward. A backend marked ``traceable`` (made of torch ops and ``triton_op``s) is
called as it is; any other runs inside the opaque private ops ``msda::_opaque_forward`` and
``msda::_opaque_backward``, which carry its name and have fake kernels.

``msda::deform_attn_backward`` is not what autograd calls: ``DeformAttn.backward`` runs the backend chosen for the
forward, with the inputs already validated. The public backward op is for callers that want the three gradients
without autograd (the extension shim's ``ms_deform_attn_backward``, in msda_core.compat); it validates and chooses
as the forward does, so the same call gives the same gradients either way.

Why this structure: ``torch.export`` keeps the public op as one node (what the ONNX translation table keys on);
``run_decompositions`` and AOTInductor replace it with the chosen backend's ops, so Triton kernels compile into
the package and the reference path lowers to aten ops; ``torch.compile`` sees through a traceable backend and
inlines its kernels; the router reads no tensor values, so it runs on fake tensors; and no private dispatch API
is needed (an autograd.Function below a composite op is what torch's own Python ops use).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import registry
from .validation import check_grad_accum, check_grad_output, check_inputs, check_tensor

SCHEMA = ("(Tensor value, Tensor spatial_shapes, Tensor? level_start_index, Tensor sampling_locations, "
          "Tensor attention_weights, *, str backend='auto', str grad_accum='auto', bool? deterministic=None) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor? level_start_index, "
                   "Tensor sampling_locations, Tensor attention_weights, *, str backend='auto', "
                   "str grad_accum='auto', bool? deterministic=None) -> (Tensor, Tensor, Tensor)")
_LIBRARY = torch.library.Library("msda", "FRAGMENT")  # held for the process's life: the registrations live with it
_LIBRARY.define("deform_attn" + SCHEMA)
_LIBRARY.define("deform_attn_backward" + BACKWARD_SCHEMA)


def output_shape(value, sampling_locations) -> tuple:
    """The op's (B, Q, M*D): for backends and tools that allocate the output themselves."""
    B, Q = sampling_locations.shape[:2]
    return (B, Q, value.shape[2] * value.shape[3])


@torch.library.custom_op("msda::_opaque_forward", mutates_args=())
def _opaque_forward(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                    sampling_locations: torch.Tensor, attention_weights: torch.Tensor, backend: str) -> torch.Tensor:
    """A backend that is not traceable, run by name: tracing records this call, not the backend's insides."""
    return registry.get(backend).forward(
        registry.Inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights))


@_opaque_forward.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend):
    return value.new_empty(output_shape(value, sampling_locations))


@torch.library.custom_op("msda::_opaque_backward", mutates_args=())
def _opaque_backward(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                     level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                     attention_weights: torch.Tensor, backend: str, grad_accum: str,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = registry.Inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return registry.get(backend).backward(grad_output, inputs, grad_accum, deterministic)


@_opaque_backward.register_fake
def _(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend,
      grad_accum, deterministic):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


class _BackendCall:
    """The backend chosen for one call, with the call's grad_accum and deterministic: runs its forward and
    backward, directly or through the opaque ops. Autograd keeps it for the backward."""

    __slots__ = ("backend", "grad_accum", "deterministic")

    def __init__(self, backend: registry.Backend, grad_accum: str, deterministic: bool):
        self.backend, self.grad_accum, self.deterministic = backend, grad_accum, deterministic

    def forward(self, inputs: registry.Inputs):
        if self.backend.traceable:
            return self.backend.forward(inputs)
        return _opaque_forward(*inputs, self.backend.name)

    def backward(self, grad_output, inputs: registry.Inputs):
        if self.backend.traceable:
            return self.backend.backward(grad_output, inputs, self.grad_accum, self.deterministic)
        return _opaque_backward(grad_output, *inputs, self.backend.name, self.grad_accum, self.deterministic)


class DeformAttn(torch.autograd.Function):
    """The op's autograd: the backend's backward gives all three gradients. Differentiating them again raises.
    Applied to the five tensors unpacked: autograd tracks an apply's tensor arguments, not a tuple's items."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call = call
        ctx.save_for_backward(*tensors)
        return call.forward(registry.Inputs(*tensors))

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # create_graph=True: first-order gradients that refuse a second derivative
            grads = FirstOrderOnly.apply(ctx.call, grad_output.contiguous(), *ctx.saved_tensors)
        else:
            grads = ctx.call.backward(grad_output.contiguous(), registry.Inputs(*ctx.saved_tensors))
        grad_value, grad_locations, grad_weights = grads
        return None, grad_value, None, None, grad_locations, grad_weights


class FirstOrderOnly(torch.autograd.Function):
    """The backward's gradients inside a graph (create_graph=True); differentiating them raises."""

    @staticmethod
    def forward(ctx, call, grad_output, *tensors):
        return call.backward(grad_output, registry.Inputs(*tensors))

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "msda.deform_attn: double backward (differentiating the gradients again) is not supported by any backend")


def _deterministic(deterministic) -> bool:
    """None follows torch.use_deterministic_algorithms, as torch's own ops do."""
    return torch.are_deterministic_algorithms_enabled() if deterministic is None else deterministic


def _with_level_starts(inputs: registry.Inputs) -> registry.Inputs:
    """The inputs with level_start_index derived from spatial_shapes where the caller passed None."""
    if inputs.level_start_index is not None:
        return inputs
    sizes = inputs.spatial_shapes.to(torch.int64).prod(1)  # on the device: no host sync, also inside graph capture
    return inputs._replace(level_start_index=sizes.cumsum(0) - sizes)


# What computes the op while an exporter records it, if anything: a function of no arguments that returns a
# replacement for the backend (with the op's signature) or None. msda_core.adapters.export sets it when msda_core is
# imported; the op core imports no adapter (imports run one way: adapters call the op).
export_time_forward: Callable[[], Callable[..., torch.Tensor] | None] | None = None


def _no_terms(inputs: registry.Inputs) -> bool:
    """B, Q, M, D or P of zero: the sum has no terms, so the result is zeros and no kernel runs."""
    return inputs.value.numel() == 0 or inputs.sampling_locations.numel() == 0


def _zeros_of(shape, *tensors):
    """Zeros of ``shape`` that autograd connects to ``tensors`` (so their gradients are zeros, not None)."""
    anchor = sum(t.reshape(-1)[:0].sum() for t in tensors)
    return tensors[0].new_zeros(shape) + anchor.to(tensors[0].dtype)


def _validate_and_resolve(inputs: registry.Inputs, backend, grad_accum, deterministic: bool,
                          grad_output=None) -> registry.Backend:
    """Validate the call (and the backward's grad_output), then resolve the backend that runs it: what both
    public ops do first."""
    check_grad_accum(grad_accum)
    check_inputs(inputs)
    if grad_output is not None:
        check_grad_output(grad_output, inputs.value, inputs.sampling_locations)
    return registry.resolve(registry.request(backend),
                            registry.Metadata.of(inputs.value, inputs.sampling_locations, grad_accum, deterministic))


def _deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *,
                 backend="auto", grad_accum="auto", deterministic=None):
    inputs = registry.Inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    differentiable = (value, sampling_locations, attention_weights)
    needs_grad = torch.is_grad_enabled() and (value.requires_grad or sampling_locations.requires_grad
                                             or attention_weights.requires_grad)
    deterministic = needs_grad and _deterministic(deterministic)  # only the backward can be nondeterministic
    chosen = _validate_and_resolve(inputs, backend, grad_accum, deterministic)
    if _no_terms(inputs):
        return _zeros_of(output_shape(value, sampling_locations), *differentiable)
    replacement = export_time_forward() if export_time_forward is not None else None
    if replacement is not None:
        return replacement(*inputs)
    inputs = _with_level_starts(inputs)
    call = _BackendCall(chosen, grad_accum, deterministic)
    if needs_grad:
        return DeformAttn.apply(call, *inputs)
    return call.forward(inputs)


def _deform_attn_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, *, backend="auto", grad_accum="auto", deterministic=None):
    inputs = registry.Inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    deterministic = _deterministic(deterministic)
    chosen = _validate_and_resolve(inputs, backend, grad_accum, deterministic, grad_output)
    if _no_terms(inputs):
        return torch.zeros_like(value), torch.zeros_like(sampling_locations), torch.zeros_like(attention_weights)
    call = _BackendCall(chosen, grad_accum, deterministic)
    return call.backward(grad_output.contiguous(), _with_level_starts(inputs))


_LIBRARY.impl("deform_attn", _deform_attn, "CompositeImplicitAutograd")
_LIBRARY.impl("deform_attn_backward", _deform_attn_backward, "CompositeImplicitAutograd")


def deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, *extra,
                backend: str = "auto", grad_accum: str = "auto", deterministic: bool | None = None) -> torch.Tensor:
    """Multi-scale deformable attention: ``torch.ops.msda.deform_attn``, with an error for a sixth positional argument.

    Each query, in each head, samples every level of a feature pyramid bilinearly at a few points and sums the
    samples with its weights (docs/math.md has the formula and its conventions). Arguments and shapes are those of
    Deformable DETR's CUDA op and mmcv's ``MultiScaleDeformableAttnFunction``, without ``im2col_step``. The op
    itself takes the same arguments and is what ``torch.compile``, ``torch.export`` and ONNX see.

    Args:
        value: (B, S, M, D) float16, bfloat16, float32 or float64: the L levels flattened row by row and
            concatenated along S = sum of H_l * W_l, M heads of D channels (any D). Its device picks the backends
            that may run (CPU: ``gather``, ``grid_sample``, ``naive``; CUDA: ``triton``, ``grid_sample``).
        spatial_shapes: (L, 2) int64 or int32, (H_l, W_l) of each level, on value's device.
        level_start_index: (L,) int64 or int32, where each level starts along S, on value's device; or None,
            which derives it from spatial_shapes.
        sampling_locations: (B, Q, M, L, P, 2) normalized (x, y): 0 and 1 are a map's edges, (i + 0.5) / W_l is
            pixel i's centre; a sample reads zeros past the edges. value's dtype, or float32 beside a float16 or
            bfloat16 value (which keeps the locations' precision).
        attention_weights: (B, Q, M, L, P) in sampling_locations' dtype; used as given (callers softmax them).
        backend: ``"auto"`` or a registered backend's name; ``"auto"`` defers to :func:`msda_core.use_backend`,
            then the ``MSDA_BACKEND`` environment variable, then the fastest backend that supports the inputs.
        grad_accum: how a backend that scatters ``grad_value`` with atomic adds (``triton``) sums float16 and
            bfloat16 gradients: ``"fp32"`` in a float32 buffer cast once at the end, ``"native"`` in the
            gradient's own dtype (each add rounds the running sum), ``"auto"`` the backend's choice from the
            shapes (``triton``: native where each element of grad_value expects at most one term, 4*Q*L*P <= S,
            as on a decoder). Other backends ignore it.
        deterministic: True makes the backward give the same bits every run (only a backend that can is
            chosen; one named that cannot is refused before the forward); None follows
            ``torch.are_deterministic_algorithms_enabled()``; False lets atomic adds vary the last bits.

    Returns:
        (B, Q, M*D) in value's dtype, on value's device: the heads' results side by side. Differentiable in
        value, sampling_locations and attention_weights, each gradient in its input's dtype; differentiating
        the gradients again raises NotImplementedError. A NaN or infinite location or weight makes its
        (b, q, m) row NaN.

    Raises:
        TypeError: a sixth positional argument (``im2col_step``: use ``msda_core.compat.MSDeformAttnFunction``),
            an argument that is not a tensor (a list), or a dtype other than those above.
        ValueError: a shape or device that does not fit the others, a CPU level table that does not describe
            value's S rows (a CUDA one is never read on the host: docs/math.md, "Level tables"), or an unknown
            grad_accum; the message names the argument, the expected and the actual value. Raised before any
            backend runs.
        msda_core.BackendUnavailableError: no backend can run the call; the message lists each backend and why.

    Example:
        >>> import torch, msda_core
        >>> shapes = torch.tensor([(4, 6), (2, 3)])          # (H, W) of L = 2 levels: S = 24 + 6
        >>> B, Q, M, D, L, P = 1, 5, 2, 8, 2, 3
        >>> value = torch.ones(B, 30, M, D, requires_grad=True)
        >>> locations = torch.full((B, Q, M, L, P, 2), 0.5)  # every sample at the centre of its map
        >>> weights = torch.full((B, Q, M, L, P), 1 / (L * P))
        >>> out = msda_core.deform_attn(value, shapes, None, locations, weights)
        >>> out.shape, out.dtype
        (torch.Size([1, 5, 16]), torch.float32)
        >>> torch.allclose(out, torch.ones(1, 5, 16))    # a constant map, weights summing to 1
        True
        >>> out.sum().backward(); value.grad.shape
        torch.Size([1, 30, 2, 8])
        >>> msda_core.deform_attn(value, shapes, None, locations[:, :, :, :1], weights)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: sampling_locations: expected shape (B, Q, M, L, P, 2) = ..., got (1, 5, 2, 1, 3, 2)
    """
    if extra:
        raise TypeError(
            f"deform_attn takes 5 positional arguments, got {5 + len(extra)}: there is no im2col_step (it only "
            "chunked the batch in the CUDA extensions). For the MSDeformAttnFunction.apply(value, spatial_shapes, "
            "level_start_index, sampling_locations, attention_weights, im2col_step) signature use "
            "msda_core.compat.MSDeformAttnFunction")
    for arg, x in zip(registry.Inputs._fields, (value, spatial_shapes, level_start_index, sampling_locations,
                                                attention_weights)):
        if x is not None or arg != "level_start_index":
            check_tensor(arg, x)
    return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, backend=backend, grad_accum=grad_accum,
                                      deterministic=deterministic)


def deform_attn_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights, *, backend: str = "auto", grad_accum: str = "auto",
                         deterministic: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's three gradients without autograd: ``torch.ops.msda.deform_attn_backward``.

    For code that calls a forward and a backward itself, as the compiled extensions' callers do
    (``msda_core.compat``'s stand-ins for them call this op). It validates and chooses a backend as
    :func:`deform_attn` does, so the same call gives the gradients autograd gives.

    Args:
        grad_output: (B, Q, M*D), any float dtype, on value's device: the gradient of the forward's output.
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, grad_accum,
            deterministic: as for :func:`deform_attn`.

    Returns:
        (grad_value, grad_sampling_locations, grad_attention_weights), each of its input's shape, dtype and
        device.

    Raises:
        TypeError, ValueError, msda_core.BackendUnavailableError: as :func:`deform_attn`, and for a grad_output
        whose shape, device or dtype does not fit.

    Example:
        >>> import torch, msda_core
        >>> shapes = torch.tensor([(4, 6), (2, 3)])
        >>> value = torch.randn(1, 30, 2, 8, requires_grad=True)
        >>> locations = torch.rand(1, 5, 2, 2, 3, 2, requires_grad=True)
        >>> weights = torch.rand(1, 5, 2, 2, 3, requires_grad=True)
        >>> out = msda_core.deform_attn(value, shapes, None, locations, weights)
        >>> grad_output = torch.randn_like(out)
        >>> grads = msda_core.deform_attn_backward(grad_output, value, shapes, None, locations, weights)
        >>> [tuple(g.shape) for g in grads]
        [(1, 30, 2, 8), (1, 5, 2, 2, 3, 2), (1, 5, 2, 2, 3)]
        >>> autograd = torch.autograd.grad(out, (value, locations, weights), grad_output)
        >>> all(torch.allclose(g, a) for g, a in zip(grads, autograd))
        True
    """
    return torch.ops.msda.deform_attn_backward(grad_output, value, spatial_shapes, level_start_index,
                                               sampling_locations, attention_weights, backend=backend,
                                               grad_accum=grad_accum, deterministic=deterministic)

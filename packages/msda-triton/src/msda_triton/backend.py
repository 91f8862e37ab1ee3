"""The ``triton`` backend: kernels.py behind two ``torch.library.triton_op``s, ``msda::_triton_forward`` and
``msda::_triton_backward``. While torch.compile or torch.export trace a call, the backend calls those ops and every
launch goes through ``torch.library.wrap_triton``, so Inductor and AOTInductor compile the kernels into their own
code. An eager call on real tensors runs the same bodies directly, skipping the custom op's dispatch, whose host
time a decoder-sized call feels (BENCHMARKS.md, "The decoder call from Python"), on CUDA tensors, or on
CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 (how CI runs the real kernels without a GPU).

Each launch site (launch_forward, fixed_point_maxima, launch_backward, finish_fixed_point) hands its kernel, its
pointers and a ``derive()`` of the rest of the launch to ``_launch``, once: traced, wrap_triton records it;
eagerly, ``launcher.launch`` runs the launcher an earlier launch of the same key left (the one private Triton API,
in its own module, with the JIT as its fallback) or derives the launch. The bodies also run on fake tensors, so
they branch on metadata only: a launch rule that depends on a size the trace leaves symbolic takes the choice
that is right for every size (launch_forward).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from msda_core import Backend, output_shape
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import kernels, launcher
from .launcher import Launch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it when kernels are defined
if INTERPRETED:
    try:
        import numpy  # noqa: F401  (what Triton's interpreter computes with)
    except ImportError as err:
        raise ImportError("TRITON_INTERPRET=1: Triton's CPU interpreter needs numpy: pip install "
                          "'msda-triton[interpreter]'") from err


# grad_accum="auto" for fp16/bf16: native adds while an element of grad_value expects at most this many terms,
# 4*Q*L*P / S per head (each of a head's Q*L*P samples adds to 4 of its S pixels), else fp32 accumulation.
# Each native add rounds the running sum, so an element of k terms errs by up to k roundings against one: at
# about one term per element (the decoder) the error stays within the dtype's own rounding, norm-wise, and the
# backward saves the fp32 buffer and its cast (decoder: 2.5x faster); the encoder (64 per element) would err 12x
# more. Measured on an H100: 0.85 u at 0.86 terms per element, past u from 1.7 (BENCHMARKS.md, "Accumulation
# paths"). Inputs that gather many samples onto a few pixels where the shapes expect few (every query on one
# spot) round more: grad_accum="fp32" keeps one rounding whatever the data.
NATIVE_ADDS_UP_TO = 1


def accumulates_in_fp32(grad_accum: str, value, sampling_locations) -> bool:
    """The accumulation switch for value's grad_value, from shapes alone (no host sync): "fp32" scatters fp16/bf16
    gradients through an fp32 buffer cast once at the end; "native" adds in the gradient's own dtype; "auto"
    takes native adds where NATIVE_ADDS_UP_TO allows, and fp32 where sizes are symbolic (right for any size)
    or where bf16 has no native atomic add (before compute capability 9.0 it is a compare-and-swap loop;
    Triton's interpreter has none). fp32 gradients are fp32 either way."""
    if value.dtype == torch.float32 or grad_accum == "native":
        return False
    if grad_accum == "fp32" or (value.dtype == torch.bfloat16 and (
            INTERPRETED or value.device.type != "cuda" or _capability(value.device) < (9, 0))):
        return True
    Q, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    return not statically_known_true(4 * Q * L * P <= NATIVE_ADDS_UP_TO * value.shape[1])


def _eager(tensor) -> bool:
    """Whether the call runs now on real tensors. Tracing (torch.compile, export) passes fake or functional
    tensors, subclasses of torch.Tensor, whose launches must be recorded through wrap_triton."""
    return type(tensor) is torch.Tensor and not torch.compiler.is_compiling()


def _launch(kernel, pointers: tuple, derive, tuned: bool = False) -> None:
    """Every launch of the backend: ``kernel`` on ``pointers`` (its leading arguments), the rest from ``derive()``
    (a Launch). Traced, through wrap_triton, which records the launch for Inductor to compile with its own
    options; eagerly, through launcher.launch with kernels.COMPILE_OPTIONS (a ``tuned`` launch, from a tuning
    config rather than the tensors' metadata, leaves no plan)."""
    if _eager(pointers[0]):
        launcher.launch(kernel, pointers, derive, kernels.COMPILE_OPTIONS, replayable=not tuned)
        return
    grid, scalars, constexprs, num_warps = derive()
    torch.library.wrap_triton(kernel)[grid](*pointers, *scalars, **constexprs, num_warps=num_warps)


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
    def derive() -> Launch:
        sizes = _sizes(value, sampling_locations)
        n_rows, Q, _, M, D = sizes[:5]
        few_rows = statically_known_true(n_rows < kernels.FEW_ROWS)
        blocks, num_warps = config or kernels.launch_config(D, backward=False, few_rows=few_rows,
                                                            value_fp32=value.dtype == torch.float32)
        block_r = blocks["BLOCK_R"]
        row_blocks = (triton.cdiv(Q, block_r) * value.shape[0] * M if blocks["HEAD_MAJOR"]
                      else triton.cdiv(n_rows, block_r))
        return Launch((row_blocks, triton.cdiv(D, blocks["BLOCK_D"])), sizes,
                      {"WIDE": needs_int64_offsets(value, sampling_locations, out), **blocks}, num_warps)

    _launch(kernels.forward_kernel, (value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                     out), derive, tuned=config is not None)


def fixed_point_maxima(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights):
    """What the deterministic mode's scales derive from (kernels._fixed_point_scales), as device scalars with
    no host sync: max|a|, max|g| and the largest anchored mass of kernels.anchor_mass_kernel."""
    weight_max = torch.linalg.vector_norm(attention_weights, float("inf"))
    grad_max = torch.linalg.vector_norm(grad_output, float("inf"))
    mass = torch.zeros(value.shape[:3], dtype=torch.int64, device=value.device)

    def derive() -> Launch:
        n_rows, Q, S, M, D, L, P = _sizes(value, sampling_locations)
        blocks, num_warps = kernels.ANCHOR_MASS_LAUNCH
        return Launch((triton.cdiv(n_rows, blocks["BLOCK_R"]),), (n_rows, Q, S, M, L, P), blocks, num_warps)

    _launch(kernels.anchor_mass_kernel, (spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                         weight_max, mass), derive)
    return weight_max, grad_max, mass.amax()


def launch_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                    grad_value, grad_locations, grad_weights, fixed_point=None, config=None):
    """Run backward_kernel on contiguous tensors; grad_value must be zeroed (it is accumulated into).
    With ``fixed_point`` = (fraction, maxima): the deterministic mode, grad_value and fraction fp32 and zeroed,
    maxima from fixed_point_maxima."""
    fraction, maxima = fixed_point or (None, (None, None, None))

    def derive() -> Launch:
        sizes = _sizes(value, sampling_locations)
        blocks, num_warps = config or kernels.launch_config(
            sizes[4], backward=True, few_rows=statically_known_true(sizes[0] < kernels.FEW_ROWS),
            half_atomics=grad_value.dtype != torch.float32)
        return Launch((triton.cdiv(sizes[0], blocks["BLOCK_R"]),), sizes,
                      {**blocks, "FIXED_POINT": fixed_point is not None}, num_warps)

    _launch(kernels.backward_kernel, (value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                      grad_output, grad_value, fraction, grad_locations, grad_weights, *maxima),
            derive, tuned=config is not None)


def finish_fixed_point(grad_value, fraction, maxima, out):
    """Write the deterministic mode's exact sums (grad_value + fraction, at maxima's scales) into ``out`` in its
    dtype, rounded once (kernels.fixed_point_finish_kernel); out may be grad_value itself."""
    def derive() -> Launch:
        blocks, num_warps = kernels.FIXED_POINT_FINISH_LAUNCH
        return Launch((triton.cdiv(out.numel(), blocks["BLOCK"]),), (out.numel(),), blocks, num_warps)

    _launch(kernels.fixed_point_finish_kernel, (grad_value, fraction, *maxima, out), derive)


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
    fp32 = deterministic or accumulates_in_fp32(grad_accum, value, sampling_locations)
    grad_value = torch.zeros(value.shape, dtype=torch.float32 if fp32 else value.dtype, device=value.device)
    grad_locations = torch.empty_like(sampling_locations)
    grad_weights = torch.empty_like(attention_weights)
    if not deterministic:
        launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights)
        return grad_value.to(value.dtype) if fp32 else grad_value, grad_locations, grad_weights
    fraction, maxima = torch.zeros_like(grad_value), fixed_point_maxima(grad_output, *inputs)
    launch_backward(grad_output, *inputs, grad_value, grad_locations, grad_weights, (fraction, maxima))
    out = grad_value if value.dtype == torch.float32 else torch.empty_like(value)  # in place: no third buffer
    finish_fixed_point(grad_value, fraction, maxima, out)
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


def forward(inputs):
    """The output, from the body directly when eager, else through the triton_op that tracing records (a
    torch.library op takes the tensors as separate arguments)."""
    run = _forward if _eager(inputs.value) else _triton_forward
    return run(*inputs)


def backward(grad_output, inputs, grad_accum, deterministic):
    """The three gradients, as forward: the body directly when eager, else the triton_op."""
    run = _backward if _eager(inputs.value) else _triton_backward
    return run(grad_output, *inputs, grad_accum, deterministic)


@functools.cache
def _capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, asked once: the query costs host time on every call otherwise."""
    return torch.cuda.get_device_capability(device)


def _limits(meta) -> list:
    if meta.device.type == "cuda" and _capability(meta.device) < (8, 0):
        return [f"needs compute capability 8.0+, {meta.device} has {'.'.join(map(str, _capability(meta.device)))}"]
    terms = meta.queries * meta.levels * meta.points  # the most an element of grad_value receives
    if meta.deterministic and terms >= kernels.MAX_EXACT_TERMS.value:
        return [f"the deterministic mode's exact fp32 sums need Q*L*P < 2^23 terms per element, got {terms}"]
    if INTERPRETED and meta.value_dtype == torch.bfloat16 and meta.grad_accum == "native":
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

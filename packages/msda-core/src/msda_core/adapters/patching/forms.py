"""Recognising a family's function: which names ``patch`` looks for, and which signatures msda serves.

Nothing here imports transformers, ultralytics or rfdetr: modules are recognised by class name and module path,
and by the global names their forward's bytecode loads. Three places a model keeps its attention function:

- a child module: transformers' parameter-free ``MultiScaleDeformableAttention`` (``is_transformers_core``);
- an instance attribute: ``CORE_ATTRIBUTE`` (transformers' D-FINE / DEIMv2, the RT-DETR and D-FINE repositories);
- a module-level name the forward calls: ``GLOBAL_NAMES`` (``forward_globals``).

A name is not enough: names are shared across codebases with other signatures and layouts, so an original is
replaced only where its parameters (names, count, defaults, ``functools.partial`` keywords) are those of one of
the checks in ``FORMS`` (``form``), and each call is checked for the layout msda serves. Even then a fork can
keep a known name and signature with other math (grid coordinates in [-1, 1], pixel units, another output
layout): ``patch`` runs the original beside msda on each site's first call and reverts a site that differs
(``verify``).

Recipe: to recognise a new family
1. Find what its forward calls: the name it loads (a global), the attribute it calls (per instance), or its
   child module's class. Write down the original's parameters (names, order, defaults) and the layouts of
   ``value``, the locations and the weights it takes and returns.
2. If the parameters are those of a check in ``FORMS``, only the name is new: add it to ``GLOBAL_NAMES`` (a new
   attribute name or child class also needs its test in the package's ``_patch_attribute`` or
   ``_patch_children``, which read ``CORE_ATTRIBUTE`` and ``is_transformers_core``). Otherwise add a drop-in with
   that signature plus ``backend=`` to ``compat`` (the conversion to ``compat.run_op``'s layout, nothing else),
   and a check here whose parameters are the original's (names and defaults: those are what ``form`` compares)
   and which returns why msda cannot serve one call (a layout msda does not take) or None; pair them in
   ``FORMS``.
3. Add the test: in ``packages/msda-core/tests/test_patch.py`` (or ``integrations/test_patterns.py`` for a
   codebase not on PyPI) a module of your own with the family's signature, layout and call, written from the
   op's definition: patched equals unpatched in float64 (outputs and gradients), its site reported verified; if
   the library is on PyPI, ``integrations/test_<library>.py`` builds its real model tiny and runs
   ``equivalence.check_patched_equals_unpatched``, and ``noxfile.py``'s integrations session installs it.
   Then list the family in the README's table.
"""

from __future__ import annotations

import dis
import inspect

import torch

from .. import compat

V2 = "multi_scale_deformable_attention_v2"
# The module-level names a forward may call multi-scale deformable attention through.
GLOBAL_NAMES = {"MSDeformAttnFunction", "MultiScaleDeformableAttnFunction", "MultiScaleDeformableAttentionFunction",
                "MultiScaleDeformableAttnFunction_fp32", "MultiScaleDeformableAttnFunction_fp16",
                "ms_deform_attn_core_pytorch", "multi_scale_deformable_attn_pytorch",
                "multi_scale_deformable_attention", V2}
# BEVFormer's Functions run under custom_fwd(cast_inputs=...): under autocast, inputs cast to this dtype.
CASTS = {"MultiScaleDeformableAttnFunction_fp32": torch.float32,
         "MultiScaleDeformableAttnFunction_fp16": torch.float16}
CORE_ATTRIBUTE = "ms_deformable_attn_core"  # per-instance core: transformers' D-FINE / DEIMv2, RT-DETR, D-FINE
# The attributes that hold a v2 caller's point counts and method (transformers' D-FINE and RT-DETRv2 name them
# num_points_list / decoder_method and n_points_list / method; the original repositories num_points_list / method).
_V2_POINTS, _V2_METHOD = ("num_points_list", "n_points_list"), ("decoder_method", "method")


def _layout(value, layout: str, heads_axis: int, sampling_locations) -> str | None:
    """Why ``value`` is not the 4-d tensor ``layout`` names, with the heads of the locations on ``heads_axis``."""
    M = sampling_locations.shape[2]
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.shape[heads_axis] != M:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        return f"value: expected {layout} with M = {M}, got {shape}"
    return None


# The calling conventions msda serves. Each check takes the arguments of the function it stands for (its
# parameter names are the ones the original must have, its defaults the ones it must keep) and says why msda
# cannot serve a call, or None; the function beside it in FORMS serves the call.
def check_child(value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step=None):
    """transformers' core module's forward."""
    return _layout(value, "(B, S, M, D)", 2, sampling_locations)


def _check_core(value, value_spatial_shapes, sampling_locations, attention_weights):
    return _layout(value, "(B, S, M, D)", 2, sampling_locations)


def _check_core_bmds(value, value_spatial_shapes, sampling_locations, attention_weights, value_spatial_shapes_hw=None):
    return _layout(value, "(B, M, D, S)", 1, sampling_locations)


def _check_function(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                    im2col_step=None):
    return _layout(value, "(B, S, M, D)", 2, sampling_locations)


def _check_v2(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list, method="default"):
    if isinstance(value, (list, tuple)):  # D-FINE: one (B, M, D, H_l*W_l) per level
        reasons = [_layout(v, "(B, M, D, H_l*W_l) per level", 1, sampling_locations) for v in value] or [
            "value: expected a tensor or one per level, got an empty sequence"]
    else:
        reasons = [_layout(value, "(B, S, M, D)", 2, sampling_locations)]
    return compat.v2_unsupported(num_points_list, method) or next(filter(None, reasons), None)


FORMS = {tuple(inspect.signature(check).parameters): (check, serve) for check, serve in (
    (_check_core, compat.multi_scale_deformable_attn_pytorch),  # Deformable DETR, mmcv, ultralytics, RT-DETR v1
    (_check_core_bmds, compat.ms_deform_attn_core_pytorch_bmds),  # RF-DETR
    (_check_function, compat.MSDeformAttnFunction.apply),  # the extension's autograd Function, mmcv's, BEVFormer's
    (_check_v2, compat.multi_scale_deformable_attention_v2),  # RT-DETRv2, D-FINE, DEIMv2
)}


def _parameters(original) -> list:
    """The parameters callers pass to ``original``: an autograd Function's forward's less ctx, a class's apply's,
    a function's or a functools.partial's (its keywords become defaults)."""
    if isinstance(original, type) and issubclass(original, torch.autograd.Function):
        return list(inspect.signature(original.forward).parameters.values())[1:]
    return list(inspect.signature(entry(original)).parameters.values())


def entry(original):
    """What calling ``original`` runs: a class (an autograd Function) is called through its ``apply``."""
    return original.apply if isinstance(original, type) else original  # type: ignore[attr-defined]


def form(original, label: str):
    """(check, serve) for the convention ``original`` follows, or why msda does not serve it (a str)."""
    try:
        parameters = _parameters(original)
    except (AttributeError, TypeError, ValueError):  # a class without apply, a builtin, not callable
        return f"{label}: {type(original).__name__} {original!r} is not a function msda recognises"
    found = FORMS.get(tuple(p.name for p in parameters))
    if found is None:
        return f"{label}({', '.join(map(str, parameters))}): not a signature msda serves"
    defaults = inspect.signature(found[0]).parameters
    for p in parameters:
        if p.default is not p.empty and p.default != defaults[p.name].default:
            return (f"{label}: {p.name}={p.default!r} bound (a functools.partial keyword or a default), msda serves "
                    f"only {p.name}={defaults[p.name].default!r}")
    return found


def served(module, original, label: str):
    """(check, serve) for what ``module`` calls as ``label`` (now ``original``), or why msda leaves it alone: a v2
    caller's own settings (point counts, method) can rule msda out before any call."""
    found = form(original, label)
    if not (isinstance(found, tuple) and found[0] is _check_v2):
        return found
    points = next((getattr(module, a) for a in _V2_POINTS if hasattr(module, a)), None)
    method = next((getattr(module, a) for a in _V2_METHOD if hasattr(module, a)), "default")
    return (None if points is None else compat.v2_unsupported(points, method)) or found


def is_transformers_core(module) -> bool:
    return type(module).__name__ == "MultiScaleDeformableAttention" and type(module).__module__.startswith(
        "transformers.")


def forward_code(module):
    """The code object of the module's forward (decorators unwrapped), or None (a builtin, a compiled forward)."""
    return getattr(inspect.unwrap(type(module).forward), "__code__", None)


def forward_globals(module):
    """The forward's module namespace and the names of GLOBAL_NAMES its bytecode loads from it."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return {}, []
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    return forward.__globals__, sorted(n for n in loaded if n in GLOBAL_NAMES and n in forward.__globals__)

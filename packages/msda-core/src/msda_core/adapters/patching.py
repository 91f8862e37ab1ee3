"""``patch(model)``: run every multi-scale deformable attention of an existing model through msda, in place.

Nothing here imports transformers, ultralytics or rfdetr: modules are recognised by class name and module path,
and by the global names their forward's bytecode loads. Mechanisms, least fragile first:

- ``child``: transformers' ten detector families (Deformable DETR, Grounding DINO, RT-DETR, ...) hold a
  parameter-free ``MultiScaleDeformableAttention`` as a wrapper's child. Each instance is replaced by
  ``msda_core.nn.MultiScaleDeformableAttention``: no class or module changes, so nothing outside this model does.
- ``attribute``: transformers' D-FINE and DEIMv2 and the original RT-DETR / RT-DETRv2 / D-FINE repositories keep
  their core function per instance (``ms_deformable_attn_core``): set on the instance, for the same reason.
- ``global``: the others call a module-level name from their forward: transformers' mask2former and
  oneformer (``multi_scale_deformable_attention``) and rt_detr_v2 (``..._v2``), ultralytics
  (``multi_scale_deformable_attn_pytorch``), RF-DETR (``ms_deform_attn_core_pytorch``), BEVFormer
  (``MultiScaleDeformableAttnFunction_fp32`` / ``_fp16``), and Deformable-DETR-style forks, mmcv and detrex
  (``MSDeformAttnFunction``, ``MultiScaleDeformableAttnFunction``, their PyTorch fallbacks). Replacing that
  global in the forward's own module keeps the library's forward code as it is, whatever fork it is; it
  holds for every model of that module in the process while any patched model uses it, so it is done only
  for modules the model contains, counted per model, and restored by the last ``unpatch``.

Names are shared across codebases with other signatures and layouts, so an original is replaced only where its
parameters (names, count, defaults, ``functools.partial`` keywords) are one of the conventions in ``_FORMS``, and
each call is checked for the layout msda serves; any other call goes to the original, counted apart. The
transformers families were read from, and are tested with, transformers 5.24.0. No parameter or buffer changes.
"""

from __future__ import annotations

import dis
import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import registry
from . import compat
from .nn import MSDeformAttn, MultiScaleDeformableAttention

_V2 = "multi_scale_deformable_attention_v2"
# The module-level names a forward may call multi-scale deformable attention through.
_GLOBAL_NAMES = {"MSDeformAttnFunction", "MultiScaleDeformableAttnFunction", "MultiScaleDeformableAttentionFunction",
                 "MultiScaleDeformableAttnFunction_fp32", "MultiScaleDeformableAttnFunction_fp16",
                 "ms_deform_attn_core_pytorch", "multi_scale_deformable_attn_pytorch",
                 "multi_scale_deformable_attention", _V2}
# BEVFormer's Functions run under custom_fwd(cast_inputs=...): under autocast, inputs cast to this dtype.
_CASTS = {"MultiScaleDeformableAttnFunction_fp32": torch.float32,
          "MultiScaleDeformableAttnFunction_fp16": torch.float16}
_CORE_ATTRIBUTE = "ms_deformable_attn_core"  # per-instance core: transformers' D-FINE / DEIMv2, RT-DETR, D-FINE
# The attributes that hold a v2 caller's point counts and method (transformers' D-FINE and RT-DETRv2 name them
# num_points_list / decoder_method and n_points_list / method; the original repositories num_points_list / method).
_V2_POINTS, _V2_METHOD = ("num_points_list", "n_points_list"), ("decoder_method", "method")
# Patched model -> its report. Nothing is stored on the model, so it still pickles and deep-copies (a deep copy
# runs patched but is not registered: unpatch applies to the original); the report holds the model weakly, and a
# model collected while patched releases its globals.
_reports: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(value, layout: str, heads_axis: int, sampling_locations) -> str | None:
    """Why ``value`` is not the 4-d tensor ``layout`` names, with the heads of the locations on ``heads_axis``."""
    M = sampling_locations.shape[2]
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.shape[heads_axis] != M:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        return f"value: expected {layout} with M = {M}, got {shape}"
    return None


# The calling conventions msda serves. Each check takes the arguments of the function it stands for (its
# parameter names are the ones the original must have, its defaults the ones it must keep) and says why msda
# cannot serve a call, or None; the function beside it in _FORMS serves the call.
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


_FORMS = {tuple(inspect.signature(check).parameters): (check, serve) for check, serve in (
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
    return list(inspect.signature(_entry(original)).parameters.values())


def _entry(original):
    """What calling ``original`` runs: a class (an autograd Function) is called through its ``apply``."""
    return original.apply if isinstance(original, type) else original  # type: ignore[attr-defined]


def _form(original, label: str):
    """(check, serve) for the convention ``original`` follows, or why msda does not serve it (a str)."""
    try:
        parameters = _parameters(original)
    except (AttributeError, TypeError, ValueError):  # a class without apply, a builtin, not callable
        return f"{label}: {type(original).__name__} {original!r} is not a function msda recognises"
    form = _FORMS.get(tuple(p.name for p in parameters))
    if form is None:
        return f"{label}({', '.join(map(str, parameters))}): not a signature msda serves"
    defaults = inspect.signature(form[0]).parameters
    for p in parameters:
        if p.default is not p.empty and p.default != defaults[p.name].default:
            return (f"{label}: {p.name}={p.default!r} bound (a functools.partial keyword or a default), msda serves "
                    f"only {p.name}={defaults[p.name].default!r}")
    return form


class _Counted:
    """What replaces a global or attribute: msda with the patch's backend where the call's arguments are laid out
    as msda serves them, the original otherwise; counts both (eager calls only: a counter dynamo saw change would
    recompile)."""

    def __init__(self, original, form, backend: str, cast: torch.dtype | None = None):
        self.original, (self.check, self.serve), self.backend, self.cast = original, form, backend, cast
        self.calls = self.fallbacks = 0
        self.fallback_reason = None

    def __call__(self, *args, **kwargs):
        reason = self.check(*args, **kwargs)
        counting = not torch.compiler.is_compiling()
        if reason:
            if counting:
                self.fallbacks, self.fallback_reason = self.fallbacks + 1, reason
            return _entry(self.original)(*args, **kwargs)
        if counting:
            self.calls += 1
        device = None if self.cast is None else (args[0] if args else kwargs["value"]).device.type
        if device is None or not torch.is_autocast_enabled(device):
            return self.serve(*args, backend=self.backend, **kwargs)
        with torch.autocast(device, enabled=False):  # as custom_fwd(cast_inputs=...): cast floats, autocast off
            return self.serve(*map(self._cast, args), backend=self.backend,
                              **{k: self._cast(v) for k, v in kwargs.items()})

    def _cast(self, x):
        is_cast = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
        return x.to(self.cast) if is_cast else x

    def apply(self, *args, **kwargs):  # Function-style globals are called as X.apply(...)
        return self(*args, **kwargs)


@dataclass
class _Global:
    """A module-level name replaced for the whole process, with the number of patched models using it."""

    namespace: dict
    name: str
    original: object
    replacement: _Counted
    users: int = 0


_globals: dict = {}  # (id(namespace), name) -> _Global


def _acquire_global(namespace: dict, name: str, form, backend: str) -> _Global:
    key = (id(namespace), name)
    entry = _globals.get(key)
    if entry is None:
        original = namespace[name]
        replacement = _Counted(original, form, backend, _CASTS.get(name))
        entry = _globals[key] = _Global(namespace, name, original, replacement)
        namespace[name] = replacement
    elif entry.replacement.backend != backend:
        raise ValueError(f"backend: expected {entry.replacement.backend!r}, the backend another patched model "
                         f"runs {namespace.get('__name__')}.{name} with (one per process), got {backend!r}")
    entry.users += 1
    return entry


def _release_globals(entries: list) -> None:
    for entry in reversed(entries):
        entry.users -= 1
        if entry.users == 0:
            entry.namespace[entry.name] = entry.original
            del _globals[(id(entry.namespace), entry.name)]


@dataclass(frozen=True)
class Patched:
    """A module whose multi-scale deformable attention now runs msda, and how."""

    name: str  # the module's qualified name in the model ("" is the model itself)
    cls: str  # module path and class of the module msda now serves
    mechanism: str
    replacement: Any = field(repr=False, compare=False)  # counts its calls: a _Counted or an msda module

    @property
    def calls(self) -> int:
        """Calls msda served (a global's: from every module in the process that calls that name)."""
        return self.replacement.calls

    @property
    def fallbacks(self) -> int:
        """Calls whose arguments msda cannot serve, passed to the original (the last one's reason in the report)."""
        return self.replacement.fallbacks

    def __str__(self) -> str:
        fallback = f" ({self.replacement.fallback_reason})" if self.fallbacks else ""
        return (f"patched {self.name or '<model>'} ({self.cls}): {self.mechanism}: {self.calls} calls through msda, "
                f"{self.fallbacks} to the original{fallback}")


@dataclass(frozen=True)
class LeftAlone:
    """A module that looks like multi-scale deformable attention but was not patched, and why."""

    name: str
    cls: str
    reason: str


class PatchReport:
    """What ``patch`` did: ``patched`` and ``left_alone`` entries, ``calls`` made through msda since. Printable.
    As a context manager, ``with msda_core.patch(model):`` unpatches the model on exit."""

    def __init__(self, model: nn.Module, backend: str):
        self._model, self._model_name, self.backend = weakref.ref(model), type(model).__name__, backend
        self.patched: list = []
        self.left_alone: list = []
        self._undo: list = []  # (weakref to a module, attribute name, original value): children and attributes
        self._globals: list = []  # the _Global entries acquired, released once: by unpatch or with the model
        self._release = weakref.finalize(model, _release_globals, self._globals)
        self._release.atexit = False

    @property
    def model(self) -> nn.Module | None:
        """The patched model (None once it has been collected)."""
        return self._model()

    @property
    def calls(self) -> int:
        """Calls through the replacements this patch installed (a global's also counts other patched models')."""
        return sum({id(p.replacement): p.calls for p in self.patched}.values())

    def __str__(self) -> str:
        lines = [f"msda_core.patch({self._model_name}, backend={self.backend!r}): "
                 f"{len(self.patched)} patched, {len(self.left_alone)} left alone"]
        lines += [f"  {p}" for p in self.patched]
        lines += [f"  left alone {e.name or '<model>'} ({e.cls}): {e.reason}" for e in self.left_alone]
        return "\n".join(lines)

    def __enter__(self) -> PatchReport:
        return self

    def __exit__(self, *exc) -> None:
        model = self.model
        if model is not None and _reports.get(model) is self:  # not when unpatched inside the block already
            unpatch(model)

    def _restore(self) -> None:
        for module, attribute, original in reversed(self._undo):
            setattr(module(), attribute, original)
        self._undo.clear()
        self._release()


def _class_name(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_transformers_core(module) -> bool:
    return type(module).__name__ == "MultiScaleDeformableAttention" and type(module).__module__.startswith(
        "transformers.")


def _v2_reason(module) -> str | None:
    """Why this v2 caller's own settings rule msda out, or None (also when they are not known: decided per call)."""
    points = next((getattr(module, a) for a in _V2_POINTS if hasattr(module, a)), None)
    method = next((getattr(module, a) for a in _V2_METHOD if hasattr(module, a)), "default")
    return None if points is None else compat.v2_unsupported(points, method)


def _served(module, original, label: str):
    """(check, serve) for what ``module`` calls as ``label`` (now ``original``), or why msda leaves it alone."""
    form = _form(original, label)
    return (_v2_reason(module) or form) if isinstance(form, tuple) and form[0] is _check_v2 else form


def _forward_globals(module):
    """The forward's module namespace and the names of _GLOBAL_NAMES its bytecode loads from it."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return {}, []
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    return forward.__globals__, sorted(n for n in loaded if n in _GLOBAL_NAMES and n in forward.__globals__)


def _patch_module(report: PatchReport, name: str, module: nn.Module) -> None:
    if isinstance(module, (MSDeformAttn, MultiScaleDeformableAttention)):
        report.left_alone.append(LeftAlone(name, _class_name(module), "already msda (its backend= applies)"))
        return
    namespace, names = _forward_globals(module)
    handled = _patch_children(report, name, module)
    handled = _patch_attribute(report, name, module) or handled
    handled = _patch_globals(report, name, module, namespace, names) or handled
    if not handled and isinstance(getattr(module, "sampling_offsets", None), nn.Linear) and isinstance(
            getattr(module, "attention_weights", None), nn.Linear):
        report.left_alone.append(LeftAlone(name, _class_name(module), "Deformable DETR's layout, but its forward "
                                           "calls nothing msda recognises"))


def _patch_children(report: PatchReport, name: str, module: nn.Module) -> bool:
    """Replace each of transformers' stateless cores among the module's children; True if it has any."""
    found = False
    for child_name, child in module.named_children():
        if not _is_transformers_core(child):
            continue
        found = True
        if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            report.left_alone.append(LeftAlone(_join(name, child_name), _class_name(child),
                                               "has parameters or buffers: not the stateless core msda replaces"))
            continue
        replacement = MultiScaleDeformableAttention(report.backend)
        setattr(module, child_name, replacement)
        report._undo.append((weakref.ref(module), child_name, child))
        report.patched.append(Patched(_join(name, child_name), _class_name(child),
                                      "child: replaced by msda_core.nn.MultiScaleDeformableAttention", replacement))
    return found


def _patch_attribute(report: PatchReport, name: str, module: nn.Module) -> bool:
    """Replace a per-instance core function (RT-DETR / D-FINE style) that msda serves; True if the module has one."""
    if _CORE_ATTRIBUTE not in vars(module):
        return False
    original = vars(module)[_CORE_ATTRIBUTE]
    form = _served(module, original, _CORE_ATTRIBUTE)
    if isinstance(form, str):
        report.left_alone.append(LeftAlone(name, _class_name(module), form))
        return True
    replacement = _Counted(original, form, report.backend)
    setattr(module, _CORE_ATTRIBUTE, replacement)
    report._undo.append((weakref.ref(module), _CORE_ATTRIBUTE, original))
    report.patched.append(Patched(name, _class_name(module), f"attribute: {_CORE_ATTRIBUTE}", replacement))
    return True


def _patch_globals(report: PatchReport, name: str, module: nn.Module, namespace: dict, names: list) -> bool:
    """Acquire each known global the module's forward calls that msda serves; True if it calls any."""
    for global_name in names:
        label = f"{namespace.get('__name__')}.{global_name}"
        entry = _globals.get((id(namespace), global_name))
        form = _served(module, entry.original if entry else namespace[global_name], label)
        if isinstance(form, str):
            report.left_alone.append(LeftAlone(name, _class_name(module), form))
            continue
        entry = _acquire_global(namespace, global_name, form, report.backend)
        report._globals.append(entry)
        report.patched.append(Patched(name, _class_name(module), f"global: {label}", entry.replacement))
    return bool(names)


def patch(model: nn.Module, *, backend: str = "auto", strict: bool = False) -> PatchReport:
    """Route every multi-scale deformable attention that ``model`` runs through msda, in place (the module
    docstring lists how, per family; transformers' families as of 5.24.0, the version tested). Returns the report;
    when nothing matched, ``strict=True`` raises and ``strict=False`` warns."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    registry.check_name(backend)
    if model in _reports:
        raise ValueError(f"model: expected a model not patched yet, got a patched {type(model).__name__} "
                         f"(call msda_core.unpatch(model) first)")
    report = PatchReport(model, backend)
    try:
        for name, module in list(model.named_modules()):  # listed first: patching replaces children
            _patch_module(report, name, module)
    except BaseException:
        report._restore()
        raise
    if not report.patched:
        if strict:
            report._restore()
            raise ValueError(f"model: expected a multi-scale deformable attention msda can serve (strict=True), "
                             f"found none in {type(model).__name__}\n{report}")
        warnings.warn(f"msda_core.patch: nothing in {type(model).__name__} runs through msda; it computes as "
                      f"before\n{report}", stacklevel=2)
    _reports[model] = report
    return report


def unpatch(model: nn.Module) -> None:
    """Undo ``patch(model)``: every child, attribute and global back as it was."""
    report = _reports.pop(model, None)
    if report is None:
        raise ValueError(f"model: expected a model patched by msda_core.patch, got an unpatched {type(model).__name__}")
    report._restore()

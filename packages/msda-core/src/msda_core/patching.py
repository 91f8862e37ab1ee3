"""``patch(model)``: run every multi-scale deformable attention of an existing model through msda, in place.

Nothing here imports transformers or ultralytics: modules are recognised by class name and module path, and
by the global names their forward's bytecode loads. Mechanisms, least fragile first:

- ``child``: transformers' ten detector families (Deformable DETR, Grounding DINO, RT-DETR, ...) hold a
  parameter-free ``MultiScaleDeformableAttention`` as a wrapper's child. Each instance is replaced by
  ``msda_core.nn.MultiScaleDeformableAttention``: no class or module changes, so nothing outside this model does.
- ``attribute``: D-FINE and DEIMv2 keep their core function per instance (``ms_deformable_attn_core``): set
  on the instance, for the same reason.
- ``global``: the others call a module-level name from their forward: transformers' mask2former and
  oneformer (``multi_scale_deformable_attention``) and rt_detr_v2 (``..._v2``), ultralytics
  (``multi_scale_deformable_attn_pytorch``), and Deformable-DETR-style forks, mmcv and detrex
  (``MSDeformAttnFunction``, ``MultiScaleDeformableAttnFunction``, their PyTorch fallbacks). Replacing that
  global in the forward's own module keeps the library's forward code as it is, whatever fork it is; it
  holds for every model of that module in the process while any patched model uses it, so it is done only
  for modules the model contains, counted per model, and restored by the last ``unpatch``.

The ``_v2`` function is served only for ``method="default"`` with equal points per level; other calls go to
the original (modules whose settings say so are reported as left alone). No parameter or buffer changes.
"""

from __future__ import annotations

import dis
import inspect
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from . import compat, registry
from .nn import MSDeformAttn, MultiScaleDeformableAttention

_V2 = "multi_scale_deformable_attention_v2"
# A global that some forward calls -> what serves it (the v2 one through _CountedV2, which guards it).
_GLOBALS = {
    "MSDeformAttnFunction": compat.MSDeformAttnFunction.apply,
    "MultiScaleDeformableAttnFunction": compat.MSDeformAttnFunction.apply,
    "MultiScaleDeformableAttentionFunction": compat.MSDeformAttnFunction.apply,
    "ms_deform_attn_core_pytorch": compat.multi_scale_deformable_attn_pytorch,
    "multi_scale_deformable_attn_pytorch": compat.multi_scale_deformable_attn_pytorch,
    "multi_scale_deformable_attention": compat.multi_scale_deformable_attn_pytorch,
    _V2: compat.multi_scale_deformable_attention_v2,
}
# The attributes that hold a v2 caller's point counts and method: D-FINE / DEIMv2, then RT-DETRv2.
_V2_SETTINGS = (("num_points_list", "decoder_method"), ("n_points_list", "method"))
_CORE_ATTRIBUTE = "ms_deformable_attn_core"  # D-FINE's and DEIMv2's per-instance core function
# Patched model -> its report. Nothing is stored on the model, so it still pickles and deep-copies (a deep copy
# runs patched but is not registered: unpatch applies to the original); the report holds the model weakly, and a
# model collected while patched releases its globals.
_reports = weakref.WeakKeyDictionary()


class _Counted:
    """What replaces a global or attribute: msda with the patch's backend; counts its eager calls (as
    nn.MultiScaleDeformableAttention does)."""

    def __init__(self, fn, backend):
        self.fn, self.backend, self.calls = fn, backend, 0

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            self.calls += 1
        return self.fn(*args, backend=self.backend, **kwargs)

    def apply(self, *args, **kwargs):  # Function-style globals are called as X.apply(...)
        return self(*args, **kwargs)


class _CountedV2(_Counted):
    """multi_scale_deformable_attention_v2: msda where it can serve the call, else the function it replaced."""

    def __init__(self, original, backend):
        super().__init__(compat.multi_scale_deformable_attention_v2, backend)
        self.original = original

    def __call__(self, value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
                 method="default"):
        if compat.v2_unsupported(num_points_list, method):
            return self.original(value, value_spatial_shapes, sampling_locations, attention_weights,
                                 num_points_list, method)
        return super().__call__(value, value_spatial_shapes, sampling_locations, attention_weights,
                                num_points_list, method)


@dataclass
class _Global:
    """A module-level name replaced for the whole process, with the number of patched models using it."""

    namespace: dict
    name: str
    original: object
    replacement: _Counted
    users: int = 0


_globals: dict = {}  # (id(namespace), name) -> _Global


def _acquire_global(namespace: dict, name: str, backend: str) -> _Global:
    key = (id(namespace), name)
    entry = _globals.get(key)
    if entry is None:
        original = namespace[name]
        replacement = _CountedV2(original, backend) if name == _V2 else _Counted(_GLOBALS[name], backend)
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
    replacement: object = field(repr=False, compare=False)  # counts its calls

    @property
    def calls(self) -> int:
        return self.replacement.calls


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
        lines += [f"  patched {p.name or '<model>'} ({p.cls}): {p.mechanism}" for p in self.patched]
        lines += [f"  left alone {e.name or '<model>'} ({e.cls}): {e.reason}" for e in self.left_alone]
        return "\n".join(lines)

    def __enter__(self) -> "PatchReport":
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
    for points, method in _V2_SETTINGS:
        if hasattr(module, points):
            return compat.v2_unsupported(getattr(module, points), getattr(module, method, "default"))
    return None


def _forward_globals(module):
    """The forward's module namespace and the names of _GLOBALS its bytecode loads from it."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return {}, []
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    return forward.__globals__, sorted(n for n in loaded if n in _GLOBALS and n in forward.__globals__)


def _patch_module(report: PatchReport, name: str, module: nn.Module) -> None:
    if isinstance(module, (MSDeformAttn, MultiScaleDeformableAttention)):
        report.left_alone.append(LeftAlone(name, _class_name(module), "already msda (its backend= applies)"))
        return
    namespace, names = _forward_globals(module)
    reason = _v2_reason(module) if _CORE_ATTRIBUTE in vars(module) or _V2 in names else None
    handled = _patch_children(report, name, module)
    handled = _patch_attribute(report, name, module, reason) or handled
    handled = _patch_globals(report, name, module, namespace, names, reason) or handled
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


def _patch_attribute(report: PatchReport, name: str, module: nn.Module, reason: str | None) -> bool:
    """Replace a D-FINE-style per-instance core function unless ``reason``; True if the module has one."""
    if _CORE_ATTRIBUTE not in vars(module):
        return False
    if reason:
        report.left_alone.append(LeftAlone(name, _class_name(module), reason))
        return True
    original = vars(module)[_CORE_ATTRIBUTE]
    replacement = _CountedV2(original, report.backend)
    setattr(module, _CORE_ATTRIBUTE, replacement)
    report._undo.append((weakref.ref(module), _CORE_ATTRIBUTE, original))
    report.patched.append(Patched(name, _class_name(module), f"attribute: {_CORE_ATTRIBUTE}", replacement))
    return True


def _patch_globals(report: PatchReport, name: str, module: nn.Module, namespace: dict, names: list,
                   reason: str | None) -> bool:
    """Acquire each known global the module's forward calls (the v2 one unless ``reason``); True if any."""
    for global_name in names:
        if global_name == _V2 and reason:
            report.left_alone.append(LeftAlone(name, _class_name(module), reason))
            continue
        entry = _acquire_global(namespace, global_name, report.backend)
        report._globals.append(entry)
        report.patched.append(Patched(name, _class_name(module),
                                      f"global: {namespace.get('__name__')}.{global_name}", entry.replacement))
    return bool(names)


def patch(model: nn.Module, *, backend: str = "auto", strict: bool = False) -> PatchReport:
    """Route every multi-scale deformable attention that ``model`` runs through msda, in place (the module
    docstring lists how, per family). Returns the report; ``strict=True`` raises when nothing matched."""
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
    if strict and not report.patched:
        report._restore()
        raise ValueError(f"model: expected a multi-scale deformable attention msda can serve (strict=True), found "
                         f"none in {type(model).__name__}\n{report}")
    _reports[model] = report
    return report


def unpatch(model: nn.Module) -> None:
    """Undo ``patch(model)``: every child, attribute and global back as it was."""
    report = _reports.pop(model, None)
    if report is None:
        raise ValueError(f"model: expected a model patched by msda_core.patch, got an unpatched {type(model).__name__}")
    report._restore()

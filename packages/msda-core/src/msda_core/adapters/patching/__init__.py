"""``patch(model)``: run every multi-scale deformable attention of an existing model through msda, in place.

``forms`` recognises a family's function (and says, as a recipe, how to add one), ``replace`` holds what
is installed and counts and verifies each module's calls, ``report`` says what was done; this module walks the
model. Mechanisms, least fragile first:

- ``child``: transformers' ten detector families (Deformable DETR, Grounding DINO, RT-DETR, ...) hold a
  parameter-free ``MultiScaleDeformableAttention`` as a wrapper's child. Each instance is replaced by a
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
  for modules the model contains, counted per model, and restored by the last ``unpatch``. Each call is
  counted for the patched module whose forward made it.

Verification: the first call msda serves at each site (a module and the function it calls) also runs the
original on the same inputs, upcast to float64, and compares the outputs within msda's forward bound for the
output's dtype (``verify.FORWARD_BOUNDS``). A site whose numbers differ runs its original from then on (a global:
for every module), with a warning, and the report lists it as left alone. The transformers families were read
from, and are tested with, transformers 5.24.0. No parameter or buffer changes.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from ... import registry
from ..nn import MSDeformAttn, MultiScaleDeformableAttention
from . import forms, replace
from .report import LeftAlone, Patched, PatchReport, _reports, report_of

__all__ = ["LeftAlone", "PatchReport", "Patched", "patch", "unpatch"]


def _class_name(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _where(name: str, module) -> str:
    return f"{name or '<model>'} ({_class_name(module)})"


def _patch_module(report: PatchReport, name: str, module: nn.Module) -> None:
    if isinstance(module, replace.PatchedCore) or isinstance(module, torch.jit.ScriptModule):
        return  # a replacement is its parent's entry; TorchScript's code is compiled, with no forward to read
    if isinstance(module, (MSDeformAttn, MultiScaleDeformableAttention)):
        report._left_alone.append(LeftAlone(name, _class_name(module), "already msda (its backend= applies)"))
        return
    handled = _patch_children(report, name, module)
    handled = _patch_attribute(report, name, module) or handled
    handled = _patch_globals(report, name, module) or handled
    if not handled and isinstance(getattr(module, "sampling_offsets", None), nn.Linear) and isinstance(
            getattr(module, "attention_weights", None), nn.Linear):
        report._left_alone.append(LeftAlone(name, _class_name(module), "Deformable DETR's layout, but its forward "
                                            "calls nothing msda recognises"))


def _carried(module: nn.Module):
    """The replacements ``module`` already holds (a deep copy's or an unpickled model's: they travel with it), as
    (attribute, replacement, its original)."""
    for child_name, child in module.named_children():
        if isinstance(child, replace.PatchedCore):
            yield child_name, child, child.site.original
    attribute = vars(module).get(forms.CORE_ATTRIBUTE)
    if isinstance(attribute, replace.Site):
        yield forms.CORE_ATTRIBUTE, attribute, attribute.original


def _patch_children(report: PatchReport, name: str, module: nn.Module) -> bool:
    """Replace each of transformers' stateless cores among the module's children; True if it has any."""
    found = False
    for child_name, child in module.named_children():
        if isinstance(child, replace.PatchedCore):  # a copy of a patched model: taken over as it is
            found = True
            report._undo.append((weakref.ref(module), child_name, child.site.original))
            report._patched.append(Patched(_join(name, child_name), _class_name(child.site.original), (child.site,),
                                           child))
            continue
        if not forms.is_transformers_core(child):
            continue
        found = True
        if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            report._left_alone.append(LeftAlone(_join(name, child_name), _class_name(child),
                                                "has parameters or buffers: not the stateless core msda replaces"))
            continue
        replacement = replace.PatchedCore(child, _where(_join(name, child_name), child), report.backend,
                                          report.verify)
        setattr(module, child_name, replacement)
        report._undo.append((weakref.ref(module), child_name, child))
        report._patched.append(Patched(_join(name, child_name), _class_name(child), (replacement.site,), replacement))
    return found


def _patch_attribute(report: PatchReport, name: str, module: nn.Module) -> bool:
    """Replace a per-instance core function (RT-DETR / D-FINE style) that msda serves; True if the module has one."""
    if forms.CORE_ATTRIBUTE not in vars(module):
        return False
    original = vars(module)[forms.CORE_ATTRIBUTE]
    if isinstance(original, replace.Site):  # a copy of a patched model: taken over as it is
        report._undo.append((weakref.ref(module), forms.CORE_ATTRIBUTE, original.original))
        report._patched.append(Patched(name, _class_name(module), (original,), original))
        return True
    found = forms.served(module, original, forms.CORE_ATTRIBUTE)
    if isinstance(found, str):
        report._left_alone.append(LeftAlone(name, _class_name(module), found))
        return True
    site = replace.attribute_site(original, found, _where(name, module), report.backend, report.verify)
    setattr(module, forms.CORE_ATTRIBUTE, site)
    report._undo.append((weakref.ref(module), forms.CORE_ATTRIBUTE, original))
    report._patched.append(Patched(name, _class_name(module), (site,), site))
    return True


def _patch_globals(report: PatchReport, name: str, module: nn.Module) -> bool:
    """Acquire each known global the module's forward calls that msda serves, one site each, all in the module's
    one entry; True if it calls any."""
    namespace, names = forms.forward_globals(module)
    sites = []
    for global_name in names:
        label = f"{namespace.get('__name__')}.{global_name}"
        refused = replace.refused.get((id(namespace), global_name))
        found = f"{label}: {refused}" if refused else forms.served(
            module, replace.original_of(namespace, global_name), label)
        if isinstance(found, str):
            report._left_alone.append(LeftAlone(name, _class_name(module), found))
            continue
        replacement = replace.acquire(namespace, global_name, found, report.backend)
        site = replacement.site(_where(name, module), report.verify)
        replacement.add(module, site)
        report._globals.append((replacement, site))
        sites.append(site)
    if sites:
        report._patched.append(Patched(name, _class_name(module), tuple(sites)))
    return bool(names)


def _modules(model: nn.Module) -> list:
    try:
        return list(model.named_modules())
    except TypeError as error:  # named_modules keeps a set of the modules it has seen
        if "unhashable" not in str(error):
            raise
        raise TypeError(f"model: expected modules torch.nn.Module.named_modules can list (it hashes each), got "
                        f"{type(model).__name__} holding one that is not hashable ({error}): a class that defines "
                        f"__eq__ needs __hash__ = torch.nn.Module.__hash__") from None


def patch(model: nn.Module, *, backend: str = "auto", strict: bool = False, verify: bool = True) -> PatchReport:
    """Route every multi-scale deformable attention that ``model`` runs through msda, in place.

    The module docstring lists how, per family (transformers' families as of 5.24.0, the version tested). The
    original's parameters are checked before it is replaced, each call's layout before msda serves it, and, with
    ``verify``, the first call msda serves at each site against the original's output on the same inputs: a site
    that differs goes back to its original for good, with a warning. Only outputs are compared: at pixel knots
    the gradients of ``sampling_offsets`` may legitimately differ (README, "Knots").

    Args:
        model: an eager ``torch.nn.Module`` (not TorchScript), on any device, in any dtype; patched in place, its
            parameters and buffers untouched.
        backend: the msda backend its attention runs ("auto": the registry chooses per call). A replaced
            module-level name runs one backend per process.
        strict: when nothing in the model runs through msda, raise instead of warning.
        verify: check each site's first eager call against the original (costs one run of the original, under
            ``torch.no_grad``, in float64). ``verify=False`` skips it: for a model already checked once.
            Calls inside ``torch.compile``'d code are neither counted nor verified.

    Returns:
        The ``PatchReport``: per module patched, its calls through msda and to the original, and its verification
        (verified with the measured difference, not verified and why, or not yet called); per module left alone,
        why. ``print(report)`` shows it; ``with msda_core.patch(model):`` unpatches on exit.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, is a TorchScript module, or holds an unhashable module.
        ValueError: ``backend`` is not a known name, ``model`` is patched already, a replaced name already runs
            another backend, or (``strict=True``) nothing was patched.

    Example:
        >>> import torch, torch.nn.functional as F, msda_core
        >>> def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
        ...                                         attention_weights):  # a library's PyTorch path, one level
        ...     (H, W), = value_spatial_shapes.tolist()
        ...     B, _, M, D = value.shape
        ...     pixels = value.permute(0, 2, 3, 1).reshape(B * M, D, H, W)
        ...     grid = 2 * sampling_locations[:, :, :, 0].transpose(1, 2).flatten(0, 1) - 1
        ...     sampled = F.grid_sample(pixels, grid, align_corners=False)  # (B*M, D, Q, P)
        ...     weights = attention_weights[:, :, :, 0].transpose(1, 2).flatten(0, 1)[:, None]
        ...     return (sampled * weights).sum(-1).view(B, M * D, -1).transpose(1, 2)
        >>> class Attention(torch.nn.Module):  # the library's module: its forward calls that function
        ...     def forward(self, value, shapes, locations, weights):
        ...         return multi_scale_deformable_attn_pytorch(value, shapes, locations, weights)
        >>> model = Attention()
        >>> report = msda_core.patch(model)
        >>> value, shapes = torch.randn(1, 12, 2, 4), torch.tensor([[3, 4]])
        >>> output = model(value, shapes, torch.rand(1, 5, 2, 1, 3, 2), torch.rand(1, 5, 2, 1, 3))
        >>> print(report.patched[0])  # doctest: +ELLIPSIS
        patched <model> (...Attention): global: ...: 1 calls through msda, 0 to the original; verified ...
        >>> msda_core.unpatch(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(f"model: expected an eager torch.nn.Module, got the TorchScript module "
                        f"{type(model).__name__} (torch.jit.script or trace compiled its code, so there is no "
                        f"forward to route): patch the eager model, then script or trace it")
    registry.check_name(backend)
    with replace.lock():
        if report_of(model) is not None:
            raise ValueError(f"model: expected a model not patched yet, got a patched {type(model).__name__} "
                             f"(call msda_core.unpatch(model) first)")
        modules = _modules(model)  # listed first: patching replaces children
        report = PatchReport(model, backend, verify)
        try:
            for name, module in modules:
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
        _reports[id(model)] = report
    return report


def unpatch(model: nn.Module) -> None:
    """Undo ``patch(model)``: every child, attribute and global back as it was.

    A deep copy (or an unpickled copy) of a patched model carries its replaced children and attributes; unpatching
    it puts their originals back. Module-level names are the process's: the copy runs them through msda until the
    last patched model using them is unpatched.

    Args:
        model: a model ``patch`` patched, or a copy of one.

    Returns:
        None; the model computes as before ``patch``.

    Raises:
        ValueError: ``model`` is not patched and carries no replacement.

    Example:
        >>> import torch, msda_core
        >>> def core(value, value_spatial_shapes, sampling_locations, attention_weights):
        ...     return msda_core.compat.multi_scale_deformable_attn_pytorch(
        ...         value, value_spatial_shapes, sampling_locations, attention_weights)
        >>> model = torch.nn.Module()
        >>> model.ms_deformable_attn_core = core  # RT-DETR keeps its core function per instance
        >>> report = msda_core.patch(model)
        >>> model.ms_deformable_attn_core is core
        False
        >>> msda_core.unpatch(model)
        >>> model.ms_deformable_attn_core is core
        True
    """
    with replace.lock():
        report = report_of(model)
        if report is not None:
            del _reports[id(model)]
            report._restore()
            return
        carried = [(module, *found) for _, module in _modules(model) for found in _carried(module)]
        if not carried:
            raise ValueError(f"model: expected a model patched by msda_core.patch, got an unpatched "
                             f"{type(model).__name__}")
        for module, attribute, _, original in carried:
            setattr(module, attribute, original)

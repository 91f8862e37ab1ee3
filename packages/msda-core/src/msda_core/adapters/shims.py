"""Stand-ins for the compiled extensions existing code imports: Deformable DETR's ``MultiScaleDeformableAttention``
module (also ``detrex._C`` and ``groundingdino._C``) and ``mmcv._ext``, registered by ``install_extension_shim``
where no working build imports. Each runs ``torch.ops.msda.deform_attn``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

import torch

from .. import op  # noqa: F401  (registers torch.ops.msda)


def _ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                            attention_weights, im2col_step):
    """The compiled extensions' forward (Deformable DETR's, GroundingDINO's, detrex's, mmcv's), its arguments
    named as mmcv's: (B, Q, M*D)."""
    return torch.ops.msda.deform_attn(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                                      attention_weights)


def _ms_deform_attn_backward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight, grad_output,
                             im2col_step):
    """Deformable DETR's backward: returns [grad_value, grad_sampling_loc, grad_attn_weight]."""
    return list(torch.ops.msda.deform_attn_backward(grad_output, value, spatial_shapes, level_start_index,
                                                    sampling_loc, attn_weight, backend="auto", grad_accum="auto"))


def _mmcv_ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                                  attention_weights, grad_output, grad_value, grad_sampling_loc, grad_attn_weight,
                                  im2col_step):
    """mmcv's backward: overwrites the three gradient tensors its caller allocated (zeros like value,
    sampling_locations and attention_weights), returns None. A buffer of another shape, dtype or device is refused
    (ValueError, TypeError) before anything runs: copied into, it would be broadcast, truncated or left as it was."""
    buffers = {"grad_value": (grad_value, value, "value"),
               "grad_sampling_loc": (grad_sampling_loc, sampling_locations, "sampling_locations"),
               "grad_attn_weight": (grad_attn_weight, attention_weights, "attention_weights")}
    for name, (buffer, like, like_name) in buffers.items():
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor like {like_name}, got {type(buffer).__name__}")
        for what, expected, actual in (("shape", tuple(like.shape), tuple(buffer.shape)),
                                       ("dtype", like.dtype, buffer.dtype), ("device", like.device, buffer.device)):
            if actual != expected:
                raise (TypeError if what == "dtype" else ValueError)(
                    f"{name}: expected {what} {expected} (the {what} of {like_name}), got {actual}")
    grads = _ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                                     attention_weights, grad_output, im2col_step)
    for (buffer, _, _), grad in zip(buffers.values(), grads):
        buffer.copy_(grad)


def _mmcv_build_info():
    return "n/a (msda's stand-in for mmcv._ext, no compiled ops)"


def _mmcv_other_op(name: str):
    """mmcv._ext's answer for an op msda does not have: mmcv.ops' import finds it (load_ext only checks that each
    name is there); a call raises."""
    if name.startswith("__"):  # Python's own protocol lookups (__path__, __wrapped__, ...): not an op
        raise AttributeError(name)

    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"mmcv op {name!r}: msda's stand-in for mmcv._ext provides only multi-scale "
                                  "deformable attention (ms_deform_attn_forward, ms_deform_attn_backward); this op "
                                  "needs mmcv's compiled extension")

    unsupported.__name__ = unsupported.__qualname__ = name
    return unsupported


def _stand_in(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name, "msda's stand-in for a compiled multi-scale deformable attention extension")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec(name) answers
    vars(module).update(functions)
    return module


def _missing(name: str) -> bool:
    """No module of that name imports: none is installed, or one is and its import fails in any way (a compiled
    extension built for another torch or CUDA: ``undefined symbol``, ``libcudart.so.12: cannot open shared object
    file`` from a ctypes load, a driver too old), which is warned with its error. False where the package above it
    is not installed (nothing to shim) or the module is already imported or stood in for. A submodule is loaded from
    its file without importing its package (detrex's __init__ itself imports detrex._C)."""
    if name in sys.modules or name in _FINDER.modules:
        return False
    parent = name.rpartition(".")[0]
    if parent:
        parent_spec = importlib.util.find_spec(parent)
        locations = parent_spec.submodule_search_locations if parent_spec else None
        if not locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(name, list(locations))
    else:
        spec = importlib.util.find_spec(name)
    if spec is None:
        return True
    if spec.loader is None:  # a namespace package: nothing to run, it imports
        return False
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as error:  # whatever a broken build raises is a broken build
        warnings.warn(f"{name} is installed but does not import ({type(error).__name__}: {error}); msda's "
                      "stand-in takes its place", RuntimeWarning, stacklevel=3)
        return True
    return False


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stand-in of a submodule whose package is not imported yet (``groundingdino._C``) when it is first
    imported, ahead of the real (broken) file: the import system then also sets the package's attribute, which a
    module put in sys.modules beforehand never gets. Each name once: after that it is in sys.modules."""

    def __init__(self):
        self.modules: dict = {}  # name -> stand-in not imported yet

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return self.modules.pop(spec.name)

    def exec_module(self, module):
        pass


_FINDER = _StandInFinder()


def _register(name: str, module: types.ModuleType) -> None:
    """``module`` as ``name``: in sys.modules, and as its package's attribute, at once where the package is
    imported, else when it is (through _FINDER)."""
    parent, _, child = name.rpartition(".")
    if not parent or parent in sys.modules:
        sys.modules[name] = module
        if parent:
            setattr(sys.modules[parent], child, module)
        return
    _FINDER.modules[name] = module
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _check_mmcv_ops_not_imported() -> None:
    """mmcv.ops' modules take ``mmcv._ext`` when they are imported: a stand-in registered later never reaches
    them. mmcv.cnn.bricks.transformer catches a failed import of mmcv.ops and goes on without the class."""
    imported = [name for name in sys.modules if name == "mmcv.ops" or name.startswith("mmcv.ops.")]
    transformer = sys.modules.get("mmcv.cnn.bricks.transformer")
    failed = transformer is not None and not hasattr(transformer, "MultiScaleDeformableAttention")
    if imported or failed:
        what = f"{imported[0]} is already imported" if imported else "an earlier import of mmcv.ops failed"
        raise RuntimeError(f"install_extension_shim(mmcv=True) was called too late: {what}. Call it before "
                           "`import mmcv.ops` (and before importing mmdet, mmcv.cnn or any model code that uses "
                           "them), e.g. first thing in the training script.")


def install_extension_shim(*, detrex: bool = False, groundingdino: bool = False, mmcv: bool = False) -> list:
    """Register msda as the compiled extensions that existing code imports, where none imports, so that code runs
    unmodified with nothing compiled.

    Always ``MultiScaleDeformableAttention``, the module Deformable DETR, Mask2Former and their forks build
    (``ms_deform_attn_forward``, ``ms_deform_attn_backward``). A name is registered only where no module of it
    imports: none is installed, or one is and its import fails in any way (a build for another torch, CUDA or
    driver: ImportError, OSError from a ctypes load, RuntimeError, ...), which is warned (RuntimeWarning, naming
    the error). A submodule is also its package's attribute (``groundingdino._C``), set when the package is
    imported. Opt-in: importing msda does not do it.

    Args:
        detrex: also ``detrex._C`` (its two attention functions, not its DCNv3 ones), where detrex is installed.
        groundingdino: also ``groundingdino._C``, where groundingdino is installed.
        mmcv: also ``mmcv._ext`` with mmcv's signatures (the backward fills the gradient tensors it is given, each
            of its input's shape, dtype and device); every other op mmcv.ops asks for is there and raises
            NotImplementedError when called; its two build-info queries answer "n/a" (mmcv.utils.collect_env, which
            BEVFormer-era training scripts call, expects strings).

    Call it before importing the package that imports the extension (first thing in the training script).

    Returns:
        list of str: the names registered now (none for names already imported or that import).

    Raises:
        RuntimeError: ``mmcv=True`` after ``mmcv.ops`` was imported (it keeps the ``mmcv._ext`` it found then).

    Example:
        >>> import torch
        >>> from msda_core import compat
        >>> registered = compat.install_extension_shim()  # [] where a working build is installed
        >>> import MultiScaleDeformableAttention as MSDA  # as Deformable DETR's ops/functions import it
        >>> value, levels = torch.rand(1, 30, 2, 8), torch.tensor([(4, 6), (2, 3)])
        >>> starts = torch.tensor([0, 24])
        >>> out = MSDA.ms_deform_attn_forward(value, levels, starts, torch.rand(1, 5, 2, 2, 3, 2),
        ...                                   torch.rand(1, 5, 2, 2, 3), 64)
        >>> tuple(out.shape)
        (1, 5, 16)
    """
    names = ["MultiScaleDeformableAttention"] + (["detrex._C"] if detrex else []) + (
        ["groundingdino._C"] if groundingdino else [])
    registered = [name for name in names if _missing(name)]
    if mmcv and _missing("mmcv._ext"):
        _check_mmcv_ops_not_imported()
        registered.append("mmcv._ext")
    shim = _stand_in("MultiScaleDeformableAttention", ms_deform_attn_forward=_ms_deform_attn_forward,
                     ms_deform_attn_backward=_ms_deform_attn_backward)
    mmcv_shim = _stand_in("mmcv._ext", ms_deform_attn_forward=_ms_deform_attn_forward,
                          ms_deform_attn_backward=_mmcv_ms_deform_attn_backward, get_compiler_version=_mmcv_build_info,
                          get_compiling_cuda_version=_mmcv_build_info, __getattr__=_mmcv_other_op)
    for name in registered:
        _register(name, mmcv_shim if name == "mmcv._ext" else shim)
    return registered

"""Stand-ins for the compiled extensions existing code imports: Deformable DETR's ``MultiScaleDeformableAttention``
module (also ``detrex._C`` and ``groundingdino._C``) and ``mmcv._ext``, registered in ``sys.modules`` by
``install_extension_shim`` where no working build imports. Each runs ``torch.ops.msda.deform_attn``.
"""

from __future__ import annotations

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
    """No module of that name imports: none is installed, or one is and its import fails (a compiled extension
    built for another torch or CUDA: ``undefined symbol``, ``libcudart.so.12: cannot open shared object file``),
    which is warned with its error. False where the package above it is not installed (nothing to shim) or the
    module is already imported. A submodule is loaded from its file without importing its package (detrex's
    __init__ itself imports detrex._C)."""
    if name in sys.modules:
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
    except ImportError as error:
        warnings.warn(f"{name} is installed but does not import ({type(error).__name__}: {error}); msda's "
                      "stand-in takes its place", RuntimeWarning, stacklevel=3)
        return True
    return False


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
    """Register, in ``sys.modules``, msda as the compiled extension that Deformable DETR, Mask2Former and their
    forks import as ``MultiScaleDeformableAttention`` (``ms_deform_attn_forward``, ``ms_deform_attn_backward``),
    so their code runs unmodified with nothing compiled. ``detrex=True`` and ``groundingdino=True`` also register
    ``detrex._C`` (not its DCNv3 functions) and ``groundingdino._C``, the same two functions, when that package is
    installed; call this before importing it. ``mmcv=True`` registers ``mmcv._ext`` with mmcv's signatures (the
    backward fills the gradient tensors it is given); every other op mmcv.ops asks for is there and raises
    NotImplementedError when called; its two build-info queries answer "n/a" (mmcv.utils.collect_env, which
    BEVFormer-era training scripts call, expects strings). Call it before ``import mmcv.ops`` (RuntimeError
    otherwise). Only where no module imports (none installed, or a broken build: warned); returns the names
    registered. Opt-in: importing msda does not do it."""
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
        sys.modules[name] = mmcv_shim if name == "mmcv._ext" else shim
    return registered

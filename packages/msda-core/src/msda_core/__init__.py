"""msda-core: the ``torch.ops.msda.deform_attn`` op, its input validation and its backend registry (``op``,
``validation``, ``registry``), and under ``adapters/`` what users call from their models.

Importing this package registers the op. Backends come from other packages (msda-reference,
msda-triton) through the ``msda.backends`` entry points.
"""

import sys

from .adapters import compat, export, hub, nn, onnx  # onnx imports onnxscript only when a table is built
from .adapters.patching import PatchReport, patch, unpatch
from .op import deform_attn, deform_attn_backward
from .op import output_shape as output_shape
from .registry import (
    Backend,
    BackendUnavailableError,
    Metadata,
    backends,
    register,
    request,
    resolve,
    unregister,
    use_backend,
)
from .registry import Inputs as Inputs
from .registry import Request as Request
from .registry import load_errors as load_errors

__version__ = "0.2.0"

# The adapters' public homes: ``import msda_core.compat`` (and export, nn, hub, onnx), as before they moved to
# adapters/.
for _adapter in (compat, export, hub, nn, onnx):
    sys.modules[f"{__name__}.{_adapter.__name__.rpartition('.')[2]}"] = _adapter


def resolve_backend(value, sampling_locations, backend: str = "auto", grad_accum: str = "auto",
                    deterministic: bool = False) -> str:
    """The name of the backend that :func:`deform_attn` would run for these tensors and options.

    Selection reads only metadata (device, dtypes, sizes), never values, so any tensors of the call's shapes
    will do. The order: ``backend`` when it is not ``"auto"``, the innermost :func:`use_backend` block, the
    ``MSDA_BACKEND`` environment variable, else the highest-priority backend that supports the inputs
    (``triton`` on CUDA, ``gather`` on the CPU).

    Args:
        value: (B, S, M, D) float tensor, as for :func:`deform_attn`.
        sampling_locations: (B, Q, M, L, P, 2) float tensor, as for :func:`deform_attn`.
        backend, grad_accum: as for :func:`deform_attn`.
        deterministic: True asks for a backend whose backward gives the same bits every run (the op asks so
            when its ``deterministic`` resolves to True and a gradient is needed).

    Returns:
        The backend's name, e.g. ``"gather"``.

    Raises:
        BackendUnavailableError: no backend can run such a call, or the one asked for cannot (or is not
            installed); the message lists every backend and why it was not used.

    Example:
        >>> import torch, msda_core
        >>> value = torch.zeros(1, 30, 2, 8)            # (B, S, M, D)
        >>> locations = torch.zeros(1, 5, 2, 2, 3, 2)   # (B, Q, M, L, P, 2)
        >>> msda_core.resolve_backend(value, locations)
        'gather'
        >>> msda_core.resolve_backend(value.double(), locations.double(), backend="naive")
        'naive'
        >>> msda_core.resolve_backend(value, locations, backend="nope")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        msda_core.registry.BackendUnavailableError: backend: expected 'auto' or one of [...], got 'nope' ...
    """
    return resolve(request(backend), Metadata.of(value, sampling_locations, grad_accum, deterministic)).name


# What users call. Also importable, for backend authors and tools: Inputs, Metadata, Request, request, resolve,
# load_errors, output_shape.
__all__ = [
    "Backend", "BackendUnavailableError", "PatchReport", "backends", "compat", "deform_attn", "deform_attn_backward",
    "export", "hub", "nn", "onnx", "patch", "register", "resolve_backend", "unpatch", "unregister", "use_backend",
]

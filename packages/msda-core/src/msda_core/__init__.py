"""msda-core: the ``torch.ops.msda.deform_attn`` op, its input validation and its backend registry (``op``,
``validation``, ``registry``), and under ``adapters/`` what users call from their models.

Importing this package registers the op. Backends come from other packages (msda-reference,
msda-triton) through the ``msda.backends`` entry points.
"""

import sys

from .adapters import compat, hub, nn, onnx  # onnx imports onnxscript only when a table is built
from .adapters.patching import PatchReport, patch, unpatch
from .op import deform_attn
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

# The adapters' public homes: ``import msda_core.compat`` (and nn, hub, onnx) as before they moved to adapters/.
for _adapter in (compat, hub, nn, onnx):
    sys.modules[f"{__name__}.{_adapter.__name__.rpartition('.')[2]}"] = _adapter


def resolve_backend(value, sampling_locations, backend: str = "auto", grad_accum: str = "auto",
                    deterministic: bool = False) -> str:
    """The name of the backend a call with these tensors would run (raises if none can)."""
    return resolve(request(backend), Metadata.of(value, sampling_locations, grad_accum, deterministic)).name


# What users call. Also importable, for backend authors and tools: Inputs, Metadata, Request, request, resolve,
# load_errors, output_shape.
__all__ = [
    "Backend", "BackendUnavailableError", "PatchReport", "backends", "compat", "deform_attn", "hub", "nn", "onnx",
    "patch", "register", "resolve_backend", "unpatch", "unregister", "use_backend",
]

"""msda-core: the ``torch.ops.msda.deform_attn`` op, its input validation and its backend registry.

Importing this package registers the op. Backends come from other packages (msda-reference,
msda-triton) through the ``msda.backends`` entry points.
"""

from . import compat, nn, onnx  # onnx imports onnxscript only when its translation table is built
from .op import deform_attn, output_shape
from .patching import PatchReport, patch, unpatch
from .registry import (
    Backend,
    BackendUnavailableError,
    Inputs,
    Request,
    backends,
    load_errors,
    register,
    request,
    requested,
    resolve,
    unregister,
    use_backend,
)

__version__ = "0.2.0"


def resolve_backend(value, sampling_locations, backend: str = "auto", grad_accum: str = "auto",
                    deterministic: bool = False) -> str:
    """The name of the backend a call with these tensors would run (raises if none can)."""
    return resolve(request(backend), Inputs.of(value, sampling_locations, grad_accum, deterministic)).name


__all__ = [
    "Backend", "BackendUnavailableError", "Inputs", "Request", "backends", "deform_attn", "load_errors",
    "output_shape", "register", "request", "requested", "resolve", "resolve_backend", "unregister", "use_backend",
]
__all__ += ["PatchReport", "compat", "nn", "onnx", "patch", "unpatch"]

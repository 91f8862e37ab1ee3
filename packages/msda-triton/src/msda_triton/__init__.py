"""msda-triton: Triton kernels of msda.deform_attn (forward, the three gradients, the accumulation switch).

The backend object lives in ``msda_triton.backend``. The entry point (``msda.backends: triton``) names
``msda_triton.BACKEND``, a ``LazyBackend`` that imports it only when a call asks for the triton backend, or
``"auto"`` looks for one on a CUDA device: a CPU process never imports Triton or Inductor. Importing this package
alone imports neither torch nor Triton, so ``compile_ptx`` can load just the kernels.
"""

__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "BACKEND":
        from msda_core.registry import LazyBackend

        # auto_devices and priority as msda_triton.backend.BACKEND's (a test holds them equal)
        return LazyBackend("triton", "msda_triton.backend:BACKEND", auto_devices=frozenset({"cuda"}), priority=100)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

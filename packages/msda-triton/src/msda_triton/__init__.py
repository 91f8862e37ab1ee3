"""msda-triton: Triton kernels of msda.deform_attn (forward, the three gradients, the accumulation switch).

The backend object lives in ``msda_triton.backend`` (entry point ``msda.backends: triton``); importing this
package alone imports neither torch nor Triton, so ``compile_ptx`` can load just the kernels.
"""

__version__ = "0.2.0"

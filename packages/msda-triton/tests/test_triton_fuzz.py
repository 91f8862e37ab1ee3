"""Random valid and malformed calls on the Triton kernels (msda_testkit.fuzz; on the GPU, or on CPU through Triton's
interpreter, TRITON_INTERPRET=1): float64 naive's result within the tolerance table, or an error naming the broken
argument.
Hypothesis' fixed examples, then a fresh random seed (named on failure; MSDA_FUZZ_SEED=<seed> replays it)."""

import pytest
import torch
from msda_testkit import fuzz
from triton_env import DEVICE, needs_kernels

EXAMPLES = 40  # per run: the interpreter runs each kernel in Python


@needs_kernels
@pytest.mark.parametrize("run", ["fixed", "fresh seed"])
def test_fuzz(run):
    fuzz.fuzz("triton", EXAMPLES, seed=None if run == "fixed" else fuzz.fresh_seed(),
              dtypes=(torch.float32, torch.float16, torch.bfloat16), device=DEVICE)

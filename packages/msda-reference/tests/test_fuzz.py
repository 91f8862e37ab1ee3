"""Random valid and malformed calls on every CPU backend (msda_testkit.fuzz): each gives float64 naive's result
within the tolerance table, or an error naming the broken argument. Each backend runs hypothesis' fixed examples
and a fresh random seed (named on failure; MSDA_FUZZ_SEED=<seed> replays it)."""

import pytest
from msda_testkit import fuzz

EXAMPLES = 100  # per backend and run


@pytest.mark.parametrize("run", ["fixed", "fresh seed"])
@pytest.mark.parametrize("backend", ["naive", "grid_sample", "gather"])
def test_fuzz(backend, run):
    fuzz.fuzz(backend, EXAMPLES, seed=None if run == "fixed" else fuzz.fresh_seed())

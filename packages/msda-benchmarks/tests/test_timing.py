"""graph_ms on the GPU: a backward is captured whatever garbage earlier calls left."""

import gc

import pytest
import torch
from msda_benchmarks.bench import training_leaves, with_backward
from msda_benchmarks.timing import graph_ms
from msda_testkit.cases import Case, grad_output_for, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture
def no_automatic_gc():
    gc.disable()
    yield
    gc.enable()


def test_captures_a_backward_while_a_reference_cycle_holds_an_earlier_graph(no_automatic_gc):
    """An earlier call's autograd graph of the same leaves, built on the default stream and kept alive only by a
    reference cycle (torch's first call of an op leaves one), made the peers run's first case uncapturable."""
    inputs = make_inputs(Case("decoder_like", batch=2, queries=30, heads=8, head_dim=32, points=4), torch.float32,
                         device="cuda")
    leaves = training_leaves(inputs)

    def forward():
        return torch.ops.msda.deform_attn(**leaves)

    cycle = [forward()]
    cycle.append(cycle)
    del cycle
    assert graph_ms(with_backward(forward, leaves, grad_output_for(inputs))) is not None

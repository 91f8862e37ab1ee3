import msda_core
import pytest
import torch
from core_inputs import tiny_inputs


@pytest.fixture
def inputs():
    return tiny_inputs()


@pytest.fixture
def marker_backend():
    """A registered backend named "marker" that counts its forwards (zeros out), so a test can see a backend
    name reach the op."""
    calls = []

    def forward(value, shapes, starts, loc, weights):
        calls.append(1)
        return value.new_zeros(msda_core.output_shape(value, loc))

    def backward(grad, value, shapes, starts, loc, weights, grad_accum, deterministic):
        return torch.zeros_like(value), torch.zeros_like(loc), torch.zeros_like(weights)

    msda_core.register(msda_core.Backend("marker", forward, backward, devices=frozenset({"cpu"}),
                                         dtypes=frozenset({torch.float32, torch.float64})))
    yield calls
    msda_core.unregister("marker")

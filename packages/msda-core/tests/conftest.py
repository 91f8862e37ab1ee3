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

    def forward(inputs):
        calls.append(1)
        return inputs.value.new_zeros(msda_core.output_shape(inputs.value, inputs.sampling_locations))

    def backward(grad, inputs, grad_accum, deterministic):
        return tuple(torch.zeros_like(t) for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights))

    msda_core.register(msda_core.Backend("marker", forward, backward, devices=frozenset({"cpu"}),
                                         dtypes=frozenset({torch.float32, torch.float64})))
    yield calls
    msda_core.unregister("marker")

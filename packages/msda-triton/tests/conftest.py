import pytest
from msda_triton import backend


@pytest.fixture(params=backend.GRAD_VALUE_METHODS)
def grad_value_method(request, monkeypatch):
    """Each of the backward's ways to make grad_value, forced through the production launches."""
    monkeypatch.setattr(backend, "GRAD_VALUE_METHOD", request.param)
    return request.param


@pytest.fixture
def binned(monkeypatch):
    """The binned variant of the backward (backend.launch_binned_grad_value), forced."""
    monkeypatch.setattr(backend, "GRAD_VALUE_METHOD", "binned")

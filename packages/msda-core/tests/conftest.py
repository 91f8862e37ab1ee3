import pytest
from core_inputs import tiny_inputs


@pytest.fixture
def inputs():
    return tiny_inputs()

"""The export entry points' own errors: an absent optional dependency names the extra that installs it, and a
wrong form names the argument. (The graphs themselves are judged in msda-reference's test_onnx.py and by the
conformance suite's export checks, where backends give the eager results.)"""

import sys

import msda_core
import pytest


@pytest.mark.parametrize("module, form", [("onnxscript", "gather"), ("onnxscript", "grid_sample"),
                                          ("onnx", "tensorrt")])
def test_translation_table_names_the_extra_when_its_dependency_is_absent(monkeypatch, module, form):
    """None in sys.modules makes the import fail, whether or not the package is installed."""
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ModuleNotFoundError, match=rf"needs {module}, which is not installed: pip install "
                                                  r"'msda-core\[onnx\]'"):
        msda_core.onnx.translation_table(form)


def test_forms_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match=r"^form: expected one of \('gather', 'grid_sample', 'tensorrt'\), got 'trt'"):
        msda_core.onnx.translation_table("trt")
    with pytest.raises(ValueError, match=r"^form: expected one of .*, got 'GridSample'"):
        with msda_core.onnx.export_form("GridSample"):
            pass
    with pytest.raises(ValueError, match=r"^plugin: expected 'tensorrt' or None, got 'trt' .*choose the graph with "
                                         r"form= instead"):
        msda_core.onnx.translation_table(plugin="trt")


def test_export_form_is_scoped():
    get = msda_core.onnx._form.get
    assert get() == "gather"
    with msda_core.onnx.export_form("grid_sample"):
        assert get() == "grid_sample"
        with msda_core.onnx.export_form("tensorrt"):
            assert get() == "tensorrt"
        assert get() == "grid_sample"
    assert get() == "gather"

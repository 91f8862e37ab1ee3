"""msda_core's public names are what users call; the rest stays importable for backend authors and tools. The
adapters live in msda_core.adapters, and every name users import still imports from where it always did."""

import subprocess
import sys

import msda_core
import pytest


def test_star_import_gives_what_users_call():
    namespace: dict = {}
    exec("from msda_core import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == [
        "Backend", "BackendUnavailableError", "PatchReport", "backends", "compat", "deform_attn",
        "deform_attn_backward", "export", "hub", "nn", "onnx", "patch", "register", "resolve_backend", "unpatch",
        "unregister", "use_backend"]
    for name in ("Inputs", "Metadata", "Request", "request", "resolve", "load_errors", "output_shape"):
        assert hasattr(msda_core, name), name


# Each statement as a user's first line, in a fresh interpreter: the module aliases must work before anything
# else of msda_core was touched.
PUBLIC_IMPORTS = [
    "import msda_core.compat as m; m.install_extension_shim; m.MSDeformAttnFunction.apply; m.run_op",
    "from msda_core.compat import multi_scale_deformable_attn_pytorch, ms_deform_attn_core_pytorch_bmds",
    "from msda_core.compat import install_extension_shim, multi_scale_deformable_attention_v2, level_shapes",
    "from msda_core.nn import MSDeformAttn, MultiScaleDeformableAttention",
    "import msda_core.nn; msda_core.nn.MSDeformAttn",
    "from msda_core.hub import mapping, MultiScaleDeformableAttention, Repository",
    "from msda_core.onnx import translation_table",
    "import msda_core.onnx; msda_core.onnx.translation_table; msda_core.onnx.export_form",
    "from msda_core.export import decomposition_table, deform_attn_gather, portable",
    "from msda_core import patch, unpatch, PatchReport, deform_attn, use_backend, resolve_backend",
]


@pytest.mark.parametrize("statement", PUBLIC_IMPORTS)
def test_public_names_import_from_where_they_did(statement):
    done = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_public_modules_are_the_adapters():
    from msda_core import adapters
    for name in ("compat", "export", "nn", "hub", "onnx"):
        assert sys.modules[f"msda_core.{name}"] is getattr(adapters, name), name

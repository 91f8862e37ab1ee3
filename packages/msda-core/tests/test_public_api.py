"""msda_core's public names are what users call; the rest stays importable for backend authors and tools."""

import msda_core


def test_star_import_gives_what_users_call():
    namespace: dict = {}
    exec("from msda_core import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == [
        "Backend", "BackendUnavailableError", "PatchReport", "backends", "compat", "deform_attn", "nn", "onnx",
        "patch", "register", "resolve_backend", "unpatch", "unregister", "use_backend"]
    for name in ("Inputs", "Metadata", "Request", "request", "resolve", "load_errors", "output_shape"):
        assert hasattr(msda_core, name), name

"""The packages sit in layers: the op (msda-core), its backends (msda-reference, msda-triton), the test library
(msda-testkit), the tools (msda-benchmarks). No module imports a package of a layer above its own."""

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
ABOVE = {"msda_core": {"msda_reference", "msda_triton", "msda_testkit", "msda_benchmarks"},
         "msda_reference": {"msda_triton", "msda_testkit", "msda_benchmarks"},
         "msda_triton": {"msda_reference", "msda_testkit", "msda_benchmarks"},
         "msda_testkit": {"msda_triton", "msda_benchmarks"}}


def imported_packages(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ABOVE)
def test_no_module_imports_a_layer_above_its_own(package):
    sources = sorted((PACKAGES / package.replace("_", "-") / "src" / package).rglob("*.py"))
    assert sources
    wrong = {str(p.relative_to(PACKAGES)): sorted(imported_packages(p) & ABOVE[package]) for p in sources}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_check_sees_an_import_from_above(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom msda_benchmarks.bench import measure\n\ndef f():\n    import msda_testkit\n")
    assert imported_packages(module) == {"torch", "msda_benchmarks", "msda_testkit"}

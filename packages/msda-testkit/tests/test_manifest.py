from pathlib import Path

import msda_testkit.manifest as manifest

ROOT = Path(__file__).resolve().parents[3]
KERNEL = "import triton\n\n@triton.jit\ndef k(x):\n    pass\n"


def test_the_repository_manifest_is_complete():
    assert manifest.problems(ROOT, manifest.load(ROOT)) == []
    assert "packages/msda-triton/src/msda_triton/kernels.py" in manifest.kernel_sources(ROOT)


def _tree(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _entry(path, **extra):
    return {"path": path, "kind": "k", "nondeterminism": "n", "deterministic_branch": "d", **extra}


def test_each_kind_of_gap_is_reported(tmp_path):
    root = _tree(tmp_path, {"packages/a/k1.py": KERNEL, "packages/a/k2.py": KERNEL, "packages/a/plain.py": "x = 1\n",
                            "packages/a/build/lib/k1.py": KERNEL, "packages/a/t.py": "def test(): pass\n"})
    entries = {"kernel": [_entry("packages/a/k1.py", tests=["packages/a/t.py", "packages/a/gone.py"]),
                          _entry("packages/a/plain.py", exempt="x"),
                          _entry("packages/a/missing.py", tests=["packages/a/t.py"]),
                          {"path": "packages/a/k3.py"}]}
    found = manifest.problems(root, entries)
    assert "packages/a/k2.py: defines a @triton.jit kernel but has no entry in kernels.toml" in found
    assert "packages/a/k1.py: test packages/a/gone.py does not exist" in found
    assert "packages/a/plain.py: registered, but defines no @triton.jit kernel" in found
    assert "packages/a/missing.py: registered, but no such file" in found
    assert "packages/a/k3.py: neither tests nor an 'exempt' reason" in found
    assert "packages/a/k3.py: the entry has no 'kind'" in found
    assert not any("build" in line for line in found)  # build copies are not sources


def test_an_exemption_stands_in_for_tests(tmp_path):
    root = _tree(tmp_path, {"packages/a/k1.py": KERNEL})
    assert manifest.problems(root, {"kernel": [_entry("packages/a/k1.py", exempt="benchmark-only kernel")]}) == []

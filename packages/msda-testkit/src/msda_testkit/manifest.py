"""The kernel manifest (kernels.toml at the repository root): every Triton kernel source, its tests and
its nondeterminism, checked so that no kernel file goes unregistered or untested."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

MANIFEST = "kernels.toml"
REQUIRED = ("path", "kind", "nondeterminism", "deterministic_branch")
_JIT = re.compile(r"^\s*@triton\.jit\b", re.MULTILINE)
_NOT_SOURCES = {"build", "dist", ".nox", "__pycache__"}  # copies made by builds and tools


def kernel_sources(root: Path) -> set:
    """Paths, relative to root, of the Python files under packages/ that define a Triton kernel."""
    found = set()
    for path in (root / "packages").rglob("*.py"):
        relative = path.relative_to(root)
        if any(part in _NOT_SOURCES or part.endswith(".egg-info") for part in relative.parts):
            continue
        if _JIT.search(path.read_text(encoding="utf-8")):
            found.add(relative.as_posix())
    return found


def load(root: Path) -> dict:
    with open(root / MANIFEST, "rb") as f:
        return tomllib.load(f)


def problems(root: Path, manifest: dict) -> list:
    """Everything wrong with the manifest against the tree at root; empty when it is complete."""
    entries = manifest.get("kernel", [])
    found = []
    registered = {e.get("path") for e in entries}
    for source in sorted(kernel_sources(root) - registered):
        found.append(f"{source}: defines a @triton.jit kernel but has no entry in {MANIFEST}")
    for e in entries:
        where = e.get("path", "<entry without path>")
        found += [f"{where}: the entry has no {key!r}" for key in REQUIRED if not e.get(key)]
        if "path" in e and not (root / e["path"]).is_file():
            found.append(f"{where}: registered, but no such file")
        elif "path" in e and not _JIT.search((root / e["path"]).read_text(encoding="utf-8")):
            found.append(f"{where}: registered, but defines no @triton.jit kernel")
        tests = e.get("tests", [])
        if not tests and not e.get("exempt"):
            found.append(f"{where}: neither tests nor an 'exempt' reason")
        found += [f"{where}: test {t} does not exist" for t in tests if not (root / t).is_file()]
    return found

"""Check the metadata our wheels carry (nox -s packages): every range a package declares for a sibling, in its
dependencies or its extras, admits the sibling's own version; each declared package-data file is in its wheel;
and each wheel states its license (with the license file inside), a readme, classifiers and the Python that CI
runs. Arguments: the wheels' paths."""

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

PACKAGE_DATA = {"msda-testkit": ["msda_testkit/aoti_runner.cpp"]}
REQUIRES_PYTHON = ">=3.11"  # the lowest Python CI runs (noxfile: the sessions' Python)


def metadata(wheel: str):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode()), archive.namelist()


def main(wheels: list) -> int:
    found = {}
    for wheel in wheels:
        meta, files = metadata(wheel)
        found[meta["Name"]] = (meta, files)
    versions = {name: meta["Version"] for name, (meta, _) in found.items()}
    problems = []
    for name, (meta, files) in found.items():
        for line in meta.get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            sibling = versions.get(requirement.name)
            if sibling is not None and not requirement.specifier.contains(sibling, prereleases=True):
                problems.append(f"{name} {versions[name]} requires {line!r}, but {requirement.name} is {sibling}")
        if meta["License-Expression"] != "Apache-2.0" or not any(f.endswith("/licenses/LICENSE") for f in files):
            problems.append(f"{name}'s wheel lacks the license expression Apache-2.0 or the LICENSE file")
        if not meta.get_payload() or not meta.get_all("Classifier"):
            problems.append(f"{name}'s wheel lacks a readme or classifiers")
        if meta["Requires-Python"] != REQUIRES_PYTHON:
            problems.append(f"{name} requires Python {meta['Requires-Python']}, CI tests {REQUIRES_PYTHON}")
        for data in PACKAGE_DATA.get(name, []):
            if data not in files:
                problems.append(f"{name}'s wheel lacks its package data {data}")
        print(f"{name} {versions[name]}: " + ", ".join(meta.get_all("Requires-Dist") or ["no dependencies"]))
    print("\n".join(problems) or f"{len(found)} wheels: every sibling range admits the sibling's version")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

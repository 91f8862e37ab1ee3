#!/usr/bin/env bash
# CI on a CPU-only machine: install nox, then run the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "nox>=2024.4"
python3 -m nox -s cpu compile_ptx

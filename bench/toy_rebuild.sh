#!/usr/bin/env bash
# Rebuild the toy bases (SD 1.x, then FLUX.2 Klein) from scratch and compare each with its shipped manifest (about
# 20 + 25 minutes on 2 idle CPU cores): the slow test that CI's default run leaves out. Run from the repository root with the venv active.
set -euo pipefail
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_toy_build.py tests/test_toy_klein_build.py
# the shipped toy Klein base's and its demo's measures (8 seeds; in the default run too, ~3 minutes)
OMP_NUM_THREADS=1 python -m pytest -q tests/test_toy_klein.py

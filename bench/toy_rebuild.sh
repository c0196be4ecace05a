#!/usr/bin/env bash
# Rebuild the toy bases (SD 1.x, then FLUX.2 Klein and Z-Image) from scratch and compare each with its shipped manifest
# (about 25 + 20 + 30 minutes on 2 idle CPU cores): the slow test that CI's default run leaves out. Run from the repository root with the venv active.
set -euo pipefail
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_toy_build.py tests/test_toy_flow_build.py
# the shipped toy Klein and Z-Image bases' and their demos' measures (8 seeds; in the default run too, ~3 minutes each)
OMP_NUM_THREADS=1 python -m pytest -q tests/test_toy_klein.py tests/test_toy_z_image.py

#!/usr/bin/env bash
# Rebuild the toy base from scratch and compare it with the shipped manifest (about 20 minutes on 2 idle CPU
# cores): the slow test that CI's default run leaves out. Run from the repository root with the venv active.
set -euo pipefail
cd "$(dirname "$0")/.."
OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_toy_build.py

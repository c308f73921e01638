#!/usr/bin/env bash
# Create ./.venv with everything gear_mpi, its tests and its benchmarks need, on a fresh machine.
# torch==2.13.0 is installed first so that pip does not pull a multi-GB CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
.venv/bin/python -m pip install -q -e ".[mpi,test]"

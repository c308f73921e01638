#!/usr/bin/env bash
# One prepared run of every GPU check on a lent GPU machine (about 4-7 minutes):
#   1. sets up what the machine lacks from wheels carried in $WHL (default .whl): numpy<2.5 (numba-cuda
#      cannot compile kernels with numpy 2.5), mpi4py, and the mpich wheel's MPI library and mpiexec;
#   2. prints the versions and the GPU;
#   3. runs scripts/checks/gpu_check.py (every CUDA kernel against its CPU twin at full size, the zero-copy
#      gather's GB/s beside a host-to-device copy, B=1e6 draws over N=1e8 and 1e9);
#   4. runs the device replay tests on the real GPU (tests/mpi/test_device.py at 1 rank, every mode; at 2
#      ranks sharing the GPU over node shared memory) and the device checkpoint test; an exception printed by a
#      finalizer fails them;
#   5. profiles one rank's Replay.sample (scripts/checks/gpu_sample_profile.py) and counts the warnings printed.
# Each step has its own time limit and writes its output to $OUT (default /tmp/gpu_session), so a step that
# fails or hangs leaves the others' results. Run from the repository root:
#   WHL=.whl OUT=/tmp/gpu_session bash scripts/checks/gpu_session.sh
# Wheels to carry (on any machine with pip, for the GPU machine's Python):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
#     -d .whl 'numpy<2.5' mpi4py mpich
set -u
OUT=${OUT:-/tmp/gpu_session}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "=== $(date -u +%T) $*"; }

log "setup"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/numpy-*.whl "$WHL"/mpi4py-*.whl 2>&1 | grep -v "WARNING: Running pip as" | tail -3
rm -rf /tmp/mpich && python3 -m zipfile -e "$WHL"/mpich-*.whl /tmp/mpich
MPICH=$(echo /tmp/mpich/mpich-*.data/data)
chmod +x "$MPICH"/bin/*
export PYTHONPATH="$PWD:/tmp/site" PATH="$MPICH/bin:$PATH" LD_LIBRARY_PATH="$MPICH/lib:${LD_LIBRARY_PATH:-}"
export MPI4PY_LIBMPI="$MPICH/lib"

log "versions"
nvidia-smi -L
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md, platform, sys
import numpy, torch
from mpi4py import MPI
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
for name in ("numpy", "numba", "numba-cuda", "cuda-bindings", "mpi4py"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("numpy imported", numpy.__version__, numpy.__file__)
print("MPI", MPI.Get_library_version().splitlines()[0])
EOF

log "gpu_check"
timeout 270 python3 -m scripts.checks.gpu_check 2>&1 | tee "$OUT/gpu_check.txt"
echo "gpu_check exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_check.txt"

cd tests/mpi
PYTEST="python3 -m mpi4py -m pytest -q -n0 -p no:cacheprovider -rs -W error::pytest.PytestUnraisableExceptionWarning"
log "device tests, 1 rank"
timeout 100 mpiexec -n 1 $PYTEST test_device.py test_checkpoint_device.py 2>&1 | tee "$OUT/tests_1rank.txt" | tail -25
log "device tests, 2 ranks on one GPU (node shared memory paths)"
timeout 80 mpiexec -n 2 $PYTEST test_device.py -k "shm or local" 2>&1 | tee "$OUT/tests_2ranks.txt" | tail -25
cd ../..
log "Replay.sample profile"
timeout 120 python3 -m scripts.checks.gpu_sample_profile 2>&1 | tee "$OUT/sample_profile.txt"
log "warnings printed: $(cat "$OUT"/*.txt | grep -c -E 'NumbaPerformanceWarning|Freeing dead memory')"
log "done"

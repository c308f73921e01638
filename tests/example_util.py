"""Running an example as a whole ``mpiexec`` job from a test, and checking it left no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_util import ROOT, mpiexec_path, reap_session


def run_example_job(example: Path, *args: str, ranks: int = 2, timeout: float = 300.0) -> tuple[dict, str]:
    """Run ``mpiexec -n ranks python -m mpi4py example args`` in a session of its own, with a hard timeout.

    Fails the test when the job times out, exits non-zero, leaves a process of its session running
    10 s after it ended (those are killed), or prints other than one ``RESULT {json}`` line (rank 0).
    Returns the decoded result and the job's output (stdout and stderr together).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(example), *args]
    name = f"{example.name} {' '.join(args)}".strip()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own session: every process of the job is findable
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} did not finish within {timeout:g} s:\n{out[-4000:]}")
    finally:
        left = reap_session(proc.pid, 10.0)  # ranks join their children before they exit; allow for reaping
    assert proc.returncode == 0, f"{name} failed:\n{out[-4000:]}"
    assert not left, f"processes of the job still running after it ended: {left}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (rank 0):\n{out[-3000:]}"
    return json.loads(lines[0][len("RESULT "):]), out

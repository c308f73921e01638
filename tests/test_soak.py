"""``python -m scripts.checks.soak``, briefly: 2 ranks for ~10 s must reach capacity, print a row per interval and
find resident memory flat afterwards (exit 0); a growth beyond the tolerance must exit 1."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from mpi_util import ROOT, remove_leaked_mpich_segments


def soak(*args: str, limit: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "scripts.checks.soak", "--ranks", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"soak.py did not finish within {limit} s")
    finally:
        remove_leaked_mpich_segments(started)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rows(text: str) -> list[list[float]]:
    return [[float(x) for x in ln.split()[:7]] for ln in text.splitlines()
            if re.match(r"^\s+\d+\.\d\s", ln)]


def test_soak_six_seconds_memory_flat():
    proc = soak("--seconds", "6", "--interval", "1", "--capacity", "20000")
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    table = rows(proc.stdout)
    assert len(table) >= 4, out
    time_s, inserts, samples, updates, mbps, rss, items = zip(*table)
    # rows come every interval from the first one (when the replay is full), so the last lies within about
    # one interval of the end (8.9 s seen under load: the first row's clock starts a little after the run's)
    assert list(time_s) == sorted(time_s) and time_s[-1] >= 4.5, out
    assert all(x > 0 for x in inserts[1:]) and all(x > 0 for x in samples[1:]) and all(x > 0 for x in mbps[1:])
    assert "full after" in proc.stdout and "# memory: flat" in proc.stdout, out
    growth = float(re.search(r"growth after capacity: ([+-][\d.]+) MiB", proc.stdout).group(1))
    assert growth <= 16.0, out
    assert "yes" in proc.stdout.splitlines()[-4], out  # still full at the end


def test_soak_reports_growth_beyond_the_tolerance():
    proc = soak("--seconds", "3", "--interval", "0.5", "--capacity", "4000", "--tolerance-mb", "-1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "# memory: GROWING" in proc.stdout, proc.stdout

"""gear_mpi's thread defaults (gear_mpi.threads): idle numba workers sleep, GEAR_MPI_THREADS and set_threads.

Each case runs a fresh interpreter (the threading layer and OpenMP read their settings once per process) that
imports gear_mpi, runs a sample large enough to use the parallel copy kernel, and prints what it finds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gear_mpi as gm

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, os, resource, time
import numpy as np
import gear_mpi as gm
import numba
spec = gm.TrajectorySpec({"obs": ((256,), "float32")}, max_length=1)
shard = gm.Shard(spec, 8192, gm.Uniform(), seed=0)
shard.insert_packed({"obs": np.ones((8192, 256), np.float32)}, np.ones(8192, np.int64))
for _ in range(20):
    shard.sample(2048, 1)  # 2 MiB copied: above gather.COPY_THREADS_BYTES, so the parallel loop runs
t0 = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(0.3)
t1 = resource.getrusage(resource.RUSAGE_SELF)
idle_cpu = (t1.ru_utime + t1.ru_stime) - (t0.ru_utime + t0.ru_stime)
print(json.dumps({"layer": numba.threading_layer(), "wait": os.environ.get("OMP_WAIT_POLICY"),
                  "pool": numba.config.NUMBA_NUM_THREADS, "threads": gm.get_threads(), "idle_cpu": idle_cpu}))
"""


def probe(**env_changes) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS", "GEAR_MPI_THREADS")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_workers_sleep():
    """Nothing set: gear_mpi sets OMP_WAIT_POLICY=PASSIVE before numba's layer loads, and the workers that ran
    the parallel copies burn (almost) no CPU once the calls are over."""
    got = probe()
    assert got["wait"] == "PASSIVE"
    assert got["layer"] in ("omp", "workqueue", "tbb")
    assert got["idle_cpu"] < 0.05, got  # spinning OpenMP workers burn ~0.3 s each here


def test_user_choice_wins():
    got = probe(OMP_WAIT_POLICY="ACTIVE", NUMBA_THREADING_LAYER="workqueue")
    assert got["wait"] == "ACTIVE" and got["layer"] == "workqueue"


def test_env_threads():
    got = probe(GEAR_MPI_THREADS="1")
    assert got["pool"] == 1 and got["threads"] == 1 and got["wait"] == "PASSIVE"


def test_bad_env_threads_is_named():
    env = dict(os.environ, GEAR_MPI_THREADS="many", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", "import gear_mpi"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "GEAR_MPI_THREADS='many'" in out.stderr


def test_set_threads():
    before = gm.get_threads()
    try:
        assert gm.set_threads(1) == before
        assert gm.get_threads() == 1
        for bad in (0, -1, 1.5, True, 10 ** 6):
            with pytest.raises(ValueError, match="set_threads"):
                gm.set_threads(bad)
            assert gm.get_threads() == 1  # unchanged
    finally:
        gm.set_threads(before)

"""replay.batches() under real mpiexec: tests/mpi/test_prefetch.py on 1 and 3 ranks."""
from __future__ import annotations

import pytest

from mpi_util import run_pytest_mpi


@pytest.mark.parametrize("nprocs", [1, 3])
def test_prefetch_on_ranks(nprocs):
    run = run_pytest_mpi(nprocs, "test_prefetch.py", mpiexec=nprocs > 1, timeout=300)
    ran = run.passed(0)
    assert any("test_prefetched_batches_are_the_plain_samples" in t for t in ran), sorted(ran)


THREADS_PROGRAM = r"""
import numba, numpy as np, gear_mpi as gm
spec = gm.TrajectorySpec({"x": ((2,), np.float32)}, max_length=8)
with gm.Replay(spec, 400, seed=1) as replay:
    for i in range(20):
        replay.insert({"x": np.ones((8, 2), np.float32)}, 1.0)
    numba.set_num_threads(1)  # the training thread's share; a new thread would start with NUMBA_NUM_THREADS
    seen, sample = [], replay.sample
    def recording(*a, **k):
        seen.append(numba.get_num_threads())
        return sample(*a, **k)
    replay.sample = recording
    with replay.batches(4, prefetch=1, limit=3) as it:
        assert len(list(it)) == 3
print("THREADS", sorted(set(seen)))
"""


def test_the_thread_copies_with_the_callers_numba_thread_count():
    # numba's thread count is per thread: the prefetch thread used to run its kernels on every core of the
    # node (ranks x cores threads on the cores), and its samples took ~20x as long as the training thread's
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", THREADS_PROGRAM], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "THREADS [1]" in proc.stdout, proc.stdout + proc.stderr[-3000:]

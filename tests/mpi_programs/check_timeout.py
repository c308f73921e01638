"""A rank that never arrives: run as ``mpiexec -n 3 python check_timeout.py``.

The last rank never calls ``sample``; the others raise CollectiveTimeoutError within the
replay's timeout, and a second call says the replay is unusable. Every rank but the
late one prints ``PASS timeout rank=R``; tests/test_replay_mpi.py starts this with a
timeout and reads the output.

This check stays a program and not a pytest module of tests/mpi: its ranks must end
with a collective still pending (the late rank's), which MPI_Finalize would wait for
forever, so every rank leaves through ``os._exit`` -- under pytest that would skip
the rank's report, and a hook that exits the interpreter early would hide real
failures of the other tests. It also leaves MPICH's shared-memory segment behind,
which the calling test removes.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "step": ((), "int64"), "flag": ((2,), "uint8")}, max_length=12)


def fill(replay: gm.Replay, n: int, seed: int) -> None:
    """Insert ``n`` trajectories on this rank (as the tests of tests/mpi do)."""
    rng = np.random.default_rng(1000 * seed + RANK)
    for i in range(n):
        length = int(rng.integers(1, SPEC.max_length + 1))
        data = {"obs": rng.standard_normal((length, 3)).astype(np.float32),
                "step": np.arange(length, dtype=np.int64) + 100_000 * RANK + 1000 * i,
                "flag": rng.integers(0, 255, (length, 2)).astype(np.uint8)}
        replay.insert(data, priority=float(rng.uniform(0.1, 3.0)))
    comm.allgather(n)


def main() -> None:
    replay = gm.Replay(SPEC, 100, gm.Uniform(), seed=1, timeout=3.0)
    fill(replay, 3, seed=6)
    late = SIZE - 1
    if RANK == late:
        time.sleep(8.0)  # never calls sample()
        print(f"PASS timeout-late rank={RANK}", flush=True)
    else:
        t0 = time.monotonic()
        try:
            replay.sample(2, 2)
        except gm.CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            assert 2.5 < took < 7.0, took
            assert "within timeout=3 s" in str(e) and "python -m mpi4py" in str(e), str(e)
            try:
                replay.sample(2, 2)
            except gm.CollectiveError as e2:
                assert "unusable" in str(e2)
            else:
                raise AssertionError("a broken replay accepted another collective")
            print(f"PASS timeout rank={RANK} after {took:.1f}s", flush=True)
            # hydra tears the job down once a rank leaves without MPI_Finalize: give the other survivor
            # (its deadline may fire a few ms later) time to report before leaving (the late rank sleeps on)
            time.sleep(1.0)
        else:
            raise AssertionError("sample() returned although a rank never arrived")
    sys.stdout.flush()
    os._exit(0)  # pending requests would make MPI_Finalize wait for the late rank's collective


if __name__ == "__main__":
    main()

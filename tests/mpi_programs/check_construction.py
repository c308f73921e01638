"""Construction of gm.Replay as a collective, run as ``mpiexec -n 3 python check_construction.py SCENARIO``.

Scenarios:
- ``late``: the last rank never constructs; every other rank raises
  CollectiveTimeoutError naming the construction within the timeout. Prints
  ``PASS late rank=R took=<s> error=<message>`` (then ``os._exit``: a collective is pending).
- ``mismatch``: one rank passes another seed; every rank raises the same ValueError
  naming that rank, and the ranks can still construct a replay afterwards.
"""
from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

import gear_mpi as gm

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4)
TIMEOUT = 2.0


def scenario_late() -> None:
    comm.Barrier()  # every rank has started (imports take different times): the deadlines start together
    if RANK == SIZE - 1:
        time.sleep(TIMEOUT + 6.0)  # never constructs
        print(f"PASS late-rank-slept rank={RANK}", flush=True)
    else:
        t0 = time.monotonic()
        try:
            gm.Replay(SPEC, 64, gm.Uniform(), seed=1, timeout=TIMEOUT)
        except gm.CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            print(f"PASS late rank={RANK} took={took:.2f} error={e}", flush=True)
        except BaseException as e:
            print(f"WRONG late rank={RANK} {type(e).__name__}: {e}", flush=True)
        else:
            print(f"WRONG late rank={RANK}: constructed although a rank never arrived", flush=True)
        time.sleep(2.0)  # let the other ranks print before this one ends (mpiexec then ends them)
    sys.stdout.flush()
    os._exit(0)  # a collective is pending: MPI_Finalize would wait for the late rank


def scenario_mismatch() -> None:
    try:
        gm.Replay(SPEC, 64, gm.Uniform(), seed=5 if RANK == SIZE - 1 else 1, timeout=20.0)
    except ValueError as e:
        assert f"rank {SIZE - 1} was constructed with other arguments" in str(e), str(e)
        assert "construction" in str(e), str(e)
    else:
        raise AssertionError("constructed although the ranks disagree on the seed")
    with gm.Replay(SPEC, 64, gm.Uniform(), seed=1, timeout=20.0) as replay:
        replay.insert({"obs": [[1.0, 2.0, 3.0]]})
        assert len(replay.sample(2, 1)) == 2
    print(f"PASS mismatch rank={RANK}", flush=True)


if __name__ == "__main__":
    {"late": scenario_late, "mismatch": scenario_mismatch}[sys.argv[1]]()

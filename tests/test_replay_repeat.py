"""A repeated decentralized ``Replay.sample(out=)`` (gear_mpi/distributed/repeat.py), on 2 ranks of one node:
tests/mpi_programs/check_replay_repeat.py under mpiexec (about 10 s). The same batches bit for bit as the full
path through updates, inserts, uneven batch sizes and window changes (Prioritized and Uniform); no reference to
the ``out=`` batch kept; the full path's errors on every rank (a window differing between ranks, an empty
replay, a rank in another call).
"""
from __future__ import annotations

import time

from mpi_util import default_runtime, expect_passes, remove_leaked_mpi_leftovers, run_mpi

CHECKS = [f"{check}-{kind}" for kind in ("Prioritized", "Uniform")
          for check in ("same-batches", "no-reference", "window-differs", "empty", "mismatch")]


def test_a_repeated_sample_gives_the_full_paths_batches_and_errors():
    started, mpi = time.time(), default_runtime()
    try:
        proc = run_mpi(2, "check_replay_repeat.py", timeout=180, mpi=mpi)
    finally:
        remove_leaked_mpi_leftovers(started, mpi)
    expect_passes(proc, 2, CHECKS)

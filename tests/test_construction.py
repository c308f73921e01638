"""Replay construction is a collective with a deadline: tests/mpi_programs/check_construction.py on 3 ranks."""
from __future__ import annotations

import re
import time

from mpi_util import expect_passes, remove_leaked_mpich_segments, run_mpi

TIMEOUT = 2.0  # the program's Replay(timeout=...)


def test_rank_that_never_constructs_is_reported_to_every_other_rank():
    started = time.time()
    try:
        proc = run_mpi(3, "check_construction.py", "late", timeout=120)
    finally:
        remove_leaked_mpich_segments(started)  # the ranks end with a collective pending: no MPI_Finalize
    out = proc.stdout + proc.stderr[-3000:]
    assert "WRONG" not in proc.stdout, out
    found = dict((int(r), (float(t), e)) for r, t, e in re.findall(r"PASS late rank=(\d+) took=(\S+) error=(.*)",
                                                                    proc.stdout))
    assert sorted(found) == [0, 1], out
    messages = set()
    for rank, (took, message) in found.items():
        assert 0.9 * TIMEOUT < took < TIMEOUT + 3.0, (rank, took)
        assert "Replay construction" in message and f"timeout={TIMEOUT:g} s" in message, message
        messages.add(message.replace(f"this is rank {rank}", "this is rank R"))
    assert len(messages) == 1, messages  # the same error on every rank


def test_ranks_constructed_with_other_arguments_fail_on_every_rank():
    proc = run_mpi(3, "check_construction.py", "mismatch", timeout=120)
    expect_passes(proc, 3, ["mismatch"])

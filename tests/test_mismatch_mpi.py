"""Ranks in different collective calls (issue 30): tests/mpi_programs/check_mismatch.py under mpiexec.

Rank 0 makes one call of the replay and the other ranks another -- each pair of the issue
(``update_priorities`` / ``stats`` both ways, ``get_many`` / ``stats`` both ways, ``sample`` /
``stats``, ``update_priorities(keys)`` / ``sample``) and more (``sample(out=)``, a per-call local
sample, ``save``, ``RateMeter``, a ``batches()`` thread's extra deferred update against the other
ranks' sample or ``stats``). Every rank must raise the same CollectiveError naming both calls and their
number within a few seconds (the replay's timeout is 10 s), return nothing, and find the replay
unusable afterwards; over the node board (one node) and over MPI (``force_alltoallv``: no board).
"""
from __future__ import annotations

import re
import time

import pytest

from mpi_util import default_runtime, remove_leaked_mpi_leftovers, run_mpi

SCENARIOS = ["update-vs-stats", "stats-vs-update", "getmany-vs-stats", "stats-vs-getmany", "sample-vs-stats",
             "stats-vs-sample", "updatekeys-vs-sample", "sampleout-vs-getmany", "localsample-vs-update",
             "save-vs-stats", "meter-vs-update", "batches-extra-update", "batches-update-vs-stats",
             "clear-vs-sample"]


def _run(nprocs: int, transport: str, scenarios: list[str]) -> None:
    started, mpi = time.time(), default_runtime()
    try:
        proc = run_mpi(nprocs, "check_mismatch.py", transport, *scenarios, timeout=240, mpi=mpi)
    finally:
        remove_leaked_mpi_leftovers(started, mpi)  # in case a rank failed before MPI_Finalize
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out[-4000:]
    assert "WRONG" not in proc.stdout, out[-4000:]
    # whole lines, though another rank's line may follow on the same one (a rank writes each line at once)
    messages: dict[str, dict[int, str]] = {}
    for name, rank, message in re.findall(r"MSG (\S+) rank=(\d+) (collective mismatch: .*?\(close it\))",
                                          proc.stdout):
        messages.setdefault(name, {})[int(rank)] = message
    passed = set(re.findall(r"PASS (\S+) rank=(\d+)", proc.stdout))
    for scenario in scenarios:
        name = f"{transport}:{scenario}"
        assert {(name, str(r)) for r in range(nprocs)} <= passed, (name, out[-4000:])
        got = messages.get(name, {})
        assert sorted(got) == list(range(nprocs)), (name, out[-4000:])
        assert len(set(got.values())) == 1, got  # the same message on every rank


@pytest.mark.parametrize("transport", ["board", "mpi"])
def test_ranks_in_different_calls_all_raise_the_same_collective_error(transport):
    _run(2, transport, SCENARIOS)


def test_the_message_groups_ranks_by_call():
    # 3 ranks: "rank 0 called stats (call #2), ranks 1-2 called update_priorities (call #2)"
    _run(3, "board", ["stats-vs-update", "batches-update-vs-stats"])

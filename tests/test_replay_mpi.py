"""Multi-rank tests of gm.Replay: each starts ``mpiexec -n K`` on tests/mpi_programs/check_replay.py.

K = 1..4 ranks, uneven shards with an empty one, both window paths (node shared
memory, and every window forced through alltoallv). See the program's docstring
for what each scenario checks; here we check that every rank passed every check.
"""
from __future__ import annotations

import time

import pytest

from mpi_util import expect_passes, passes, remove_leaked_mpich_segments, run_mpi, run_single

SELECTORS = ("Uniform", "Prioritized", "Fifo", "Lifo", "MaxPriority", "MinPriority")


@pytest.mark.parametrize("nprocs,force", [(1, False), (2, False), (2, True), (3, True), (4, False), (4, True)])
def test_exact_windows_updates_and_order(nprocs, force):
    args = ["exact"] + (["--force"] if force else [])
    proc = run_mpi(nprocs, "check_replay.py", *args, timeout=400)
    names = [f"exact/{m}/{s}" for m in ("decentralized", "centralized") for s in SELECTORS]
    expect_passes(proc, nprocs, names + ["updates", "transport"])


@pytest.mark.parametrize("nprocs", [3, 4])
def test_global_distribution_is_exact(nprocs):
    proc = run_mpi(nprocs, "check_replay.py", "chisquare", timeout=300)
    names = [f"chisquare/{m}/{s}" for m in ("decentralized", "centralized") for s in ("Prioritized", "Uniform")]
    expect_passes(proc, nprocs, names)
    assert proc.stdout.count("chisquare ") >= 4  # rank 0's p-value lines


@pytest.mark.parametrize("nprocs,force", [(2, False), (4, True)])
def test_invalid_arguments_fail_on_every_rank(nprocs, force):
    proc = run_mpi(nprocs, "check_replay.py", "errors", *(["--force"] if force else []), timeout=200)
    expect_passes(proc, nprocs, ["errors"])


def test_rank_that_never_arrives_is_reported_after_timeout():
    started = time.time()
    try:
        proc = run_mpi(3, "check_replay.py", "timeout", timeout=120)
    finally:
        remove_leaked_mpich_segments(started)  # the ranks end with a collective pending: no MPI_Finalize
    got = passes(proc.stdout)
    for r in (0, 1):
        assert f"PASS timeout rank={r}" in got, proc.stdout + proc.stderr[-3000:]


def test_node_fence_holds_inserts_until_peers_finished_reading():
    proc = run_mpi(3, "check_replay.py", "fence", timeout=120)
    expect_passes(proc, 3, ["fence"])


def test_one_rank_without_mpiexec():
    proc = run_single("check_replay.py", "single")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert passes(proc.stdout) >= {f"PASS single/{m} rank=0" for m in ("decentralized", "centralized", "local")}

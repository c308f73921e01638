"""Multi-rank tests of gm.Replay: each starts the pytest modules of tests/mpi on K ranks.

K = 1..4 ranks, uneven shards with an empty one, both window paths (node shared
memory, and every remote window forced through alltoallv). Each start runs several
modules, so that the suite starts few jobs; a failing rank's assertion and traceback
become this test's failure (mpi_util.run_pytest_mpi). The modules' docstrings say what
each checks; run one by hand with ``mpiexec -n 3 python -m pytest tests/mpi/test_windows.py``.
"""
from __future__ import annotations

import time

import pytest

from mpi_util import passes, remove_leaked_mpich_segments, run_mpi, run_pytest_mpi

# (ranks, force every remote window through MPI, modules run by that one start)
RUNS = [
    (1, False, ["test_windows.py", "test_api.py"]),     # one plain process: an MPI singleton, no mpiexec
    (2, False, ["test_windows.py", "test_errors.py"]),
    (2, True, ["test_windows.py"]),
    (3, True, ["test_windows.py", "test_distribution.py", "test_fence.py", "test_api.py",
               "test_device.py::test_torch_comm_alltoallv_over_gloo",
               "test_device.py::test_init_torch_process_group_joins_every_rank"]),
    (4, False, ["test_windows.py", "test_distribution.py", "test_api.py"]),
    (4, True, ["test_windows.py", "test_errors.py"]),
]


@pytest.mark.parametrize("nprocs,force,modules", RUNS,
                         ids=[f"{n}-{'alltoallv' if f else 'shm'}" for n, f, _ in RUNS])
def test_replay_on_ranks(nprocs, force, modules):
    run = run_pytest_mpi(nprocs, *modules, *(["--force-alltoallv"] if force else []), mpiexec=nprocs > 1,
                         timeout=600)
    ran = run.passed(0)
    # every module ran (none was skipped whole); ranks ran the same tests (checked by run_pytest_mpi)
    for m in modules:
        assert any(t.startswith(m.split("::")[0][:-3] + "::") for t in ran), (m, sorted(ran))
    if nprocs == 1:
        assert sum("test_one_rank_in_every_mode" in t for t in ran) == 3, sorted(ran)


def test_rank_that_never_arrives_is_reported_after_timeout():
    started = time.time()
    try:
        proc = run_mpi(3, "check_timeout.py", timeout=120)
    finally:
        remove_leaked_mpich_segments(started)  # the ranks end with a collective pending: no MPI_Finalize
    got = passes(proc.stdout)
    for r in (0, 1):
        assert f"PASS timeout rank={r}" in got, proc.stdout + proc.stderr[-3000:]

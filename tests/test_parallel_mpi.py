"""Model-parallel groups and one batch per replica under real mpiexec: tests/mpi/test_parallel.py on 4 ranks
(2 DP x 2 TP, 2 DP x 2 PP, 1 DP x 4 PP; both shardings of the replay)."""
from __future__ import annotations

from mpi_util import run_pytest_mpi


def test_parallel_on_four_ranks():
    run = run_pytest_mpi(4, "test_parallel.py", timeout=300)
    ran = run.passed(0)
    for name in ("test_ranks_of_a_replica_receive_the_same_batch", "test_the_replicas_draw_the_exact_distribution"):
        assert sum(name in t for t in ran) == 4, (name, sorted(ran))

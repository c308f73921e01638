"""Writers, actor ranks and the global rate limiter under real mpiexec: tests/mpi/test_feeds.py on 1 and 3 ranks.

On 3 ranks the actor-rank test runs rank 0 as the learner and ranks 1 and 2 as actors
sending over MPI; every rank also spawns writer processes of its own.
"""
from __future__ import annotations

import pytest

from mpi_util import run_pytest_mpi


@pytest.mark.parametrize("nprocs", [1, 3])
def test_feeds_on_ranks(nprocs):
    run = run_pytest_mpi(nprocs, "test_feeds.py", mpiexec=nprocs > 1, timeout=300)
    ran = run.passed(0)
    assert any("test_rate_limiter_bounds_hold" in t for t in ran), sorted(ran)
    assert any("test_the_rate_limiter_holds_fast_writers_back" in t for t in ran), sorted(ran)
    if nprocs > 1:
        assert any("test_actor_ranks_send_episodes_over_mpi" in t for t in ran), sorted(ran)

"""replay.batches() under real mpiexec: tests/mpi/test_prefetch.py on 1 and 3 ranks."""
from __future__ import annotations

import pytest

from mpi_util import run_pytest_mpi


@pytest.mark.parametrize("nprocs", [1, 3])
def test_prefetch_on_ranks(nprocs):
    run = run_pytest_mpi(nprocs, "test_prefetch.py", mpiexec=nprocs > 1, timeout=300)
    ran = run.passed(0)
    assert any("test_prefetched_batches_are_the_plain_samples" in t for t in ran), sorted(ran)

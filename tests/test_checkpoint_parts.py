"""Ring segments stored in parts (tests/mpi/test_checkpoint_parts.py) on two ranks and on one."""
from __future__ import annotations

from mpi_util import run_pytest_mpi


def test_segment_parts_on_two_ranks():
    run_pytest_mpi(2, "test_checkpoint_parts.py", mpiexec=True, timeout=300.0)


def test_segment_parts_on_one_rank():
    run_pytest_mpi(1, "test_checkpoint_parts.py", mpiexec=False, timeout=300.0)

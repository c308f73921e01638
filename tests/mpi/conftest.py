"""Multi-rank pytest modules: every rank of ``mpiexec -n K python -m pytest tests/mpi/test_x.py`` runs them.

The modules use ``MPI.COMM_WORLD`` and plain asserts; they run unchanged on one rank
(``python -m pytest tests/mpi/test_x.py``, an MPI singleton) and on K ranks. The plain
``pytest tests`` run does not collect this folder (tests/conftest.py); wrapper tests
in tests/ start it through ``mpi_util.run_pytest_mpi``.

What this conftest adds:

- ``--force-alltoallv``: every replay built by the modules sends each remote window
  through MPI instead of copying it from node shared memory (fixture ``force``).
- With ``GEAR_MPI_REPORT_DIR`` set (by run_pytest_mpi), each rank writes its JUnit
  report to ``$GEAR_MPI_REPORT_DIR/rank<R>.xml``.
- On more than one rank, the first failing test stops that rank's session; after its
  report is printed and written, the rank calls ``MPI.COMM_WORLD.Abort`` so that the
  ranks waiting for it in a collective end at once instead of hanging.
"""
from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

COMM = MPI.COMM_WORLD
_failed = False
_session = None


def pytest_addoption(parser):
    parser.addoption("--force-alltoallv", action="store_true",
                     help="tests/mpi: send every remote window through MPI (force_alltoallv=True)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    reports = os.environ.get("GEAR_MPI_REPORT_DIR")
    if reports:
        # before the junitxml plugin's own pytest_configure reads the option
        config.option.xmlpath = os.path.join(reports, f"rank{COMM.rank}.xml")


def pytest_report_header(config):
    return f"MPI rank {COMM.rank} of {COMM.size}"


def pytest_sessionstart(session):
    global _session
    _session = session


def pytest_runtest_logreport(report):
    global _failed
    if report.failed:
        _failed = True
        if COMM.size > 1 and _session is not None:
            # the other ranks cannot go on without this one: stop after this test, as -x does
            _session.shouldstop = f"rank {COMM.rank} failed {report.nodeid}"


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _failed and COMM.size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        COMM.Abort(1)


@pytest.fixture
def force(request) -> bool:
    """Whether remote windows must go through MPI (``--force-alltoallv``)."""
    return bool(request.config.getoption("force_alltoallv"))

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
- Otherwise each rank calls ``MPI_Finalize`` itself at the end and says so when it fails (MPICH
  fails it on a communicator holding a message nobody received; the launcher then kills the job).
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
    sys.stdout.flush()
    sys.stderr.flush()
    if _failed and COMM.size > 1:
        COMM.Abort(1)
    if not MPI.Is_finalized():
        # here rather than at exit, to say why when it fails: MPICH's MPI_Finalize fails when a communicator
        # still holds a message that no receive took, skips its goodbye to the launcher, and hydra then
        # SIGKILLs every rank of the job without a word
        rank = COMM.rank
        try:
            MPI.Finalize()
        except MPI.Exception as e:
            print(f"rank {rank}: MPI_Finalize failed: {e}\n(a message sent on a communicator of this job may never "
                  f"have been received: MPICH refuses to finalize then)", file=sys.stderr, flush=True)
            os._exit(3)


@pytest.fixture
def force(request) -> bool:
    """Whether remote windows must go through MPI (``--force-alltoallv``)."""
    return bool(request.config.getoption("force_alltoallv"))

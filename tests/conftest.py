"""Shared fixtures for the gear_mpi test suite.

- ``spec`` / ``make_traj``: a multi-column spec with odd step sizes (bool, int16,
  uint8 columns next to float32 and int64) and a factory of random trajectories whose
  ``t`` column numbers every step uniquely, so a sampled window tells where it came from.
- A session-wide check that every POSIX shared-memory segment created in this
  process (``/dev/shm/gear_mpi_*``) has been unlinked when the tests end.
- ``tests/mpi/`` (pytest modules that every rank of an ``mpiexec`` job runs) is collected
  only when named on the command line; a plain ``pytest tests`` runs them through the
  wrapper tests (tests/test_replay_mpi.py, tests/test_device_path.py) on K ranks instead.
- A whole-suite run (``pytest tests``, or ``pytest`` with no path) runs on two pytest-xdist workers
  when pytest-xdist is installed and the machine has two cores or more: most multi-rank tests
  wait on their ranks, start-up or a deadline for a good part of their time, and a second worker
  fills it (946 s -> 687 s on 2 cores). Files stay whole on one worker (their module fixtures are
  built once); the files that drive a machine-wide runtime (Open MPI's session folders, the local
  Slurm cluster, the two-host namespaces, the rank-killing fault tests) run one after another on
  the same worker. ``GEAR_MPI_TEST_WORKERS=N`` sets the count (``1``: one process, as before); an
  explicit ``-n`` / ``-p no:xdist`` wins; a run of named files, an mpiexec job's ranks and
  ``--pdb`` stay in one process.
- Every process the tests start imports gear_mpi from this checkout: its root is put first on
  ``PYTHONPATH``. A program started as ``python tests/mpi_programs/x.py`` has its own folder first on
  ``sys.path`` and would otherwise find gear_mpi through the environment's editable install, which
  may point at another checkout (a git worktree sharing the main checkout's ``.venv``).
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import arenas as memory

SHM_DIR = memory.SHM_DIR
MPI_TESTS = Path(__file__).resolve().parent / "mpi"
ROOT = MPI_TESTS.parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and Path(p).resolve() != ROOT])


def pytest_ignore_collect(collection_path: Path, config):
    """Skip tests/mpi unless a command-line argument points into it (an mpiexec job does)."""
    if collection_path != MPI_TESTS:
        return None
    named = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    if any(p == MPI_TESTS or MPI_TESTS in p.parents for p in named):
        return None
    return True


#: the variable that sets how many xdist workers a whole-suite run uses (``1``: no workers)
WORKERS_VAR = "GEAR_MPI_TEST_WORKERS"
#: test files that drive something machine-wide and must not overlap one another: Open MPI (its
#: session folders, which a failed job's clean-up removes by age), the local Slurm cluster (one node,
#: started and reconfigured by these tests), the two-host namespaces, the jobs whose ranks are killed
EXCLUSIVE_FILES = frozenset({"test_openmpi.py", "test_faults.py", "test_slurm.py", "test_two_hosts.py"})


def _whole_suite(config) -> bool:
    """Whether this run collects the whole suite: no path named, or only the tests folder itself."""
    here = MPI_TESTS.parent
    args = [Path(str(a).split("::")[0]) for a in config.args] or [here]
    return all(a.resolve() == here for a in args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Run a whole-suite run on ``$GEAR_MPI_TEST_WORKERS`` (default 2) xdist workers, files kept whole."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    if os.environ.get("GEAR_MPI_REPORT_DIR") or config.getoption("numprocesses", None) is not None:
        return None  # a rank of an mpiexec job, or a count given on the command line
    if config.getoption("dist", "no") != "no" or config.getoption("usepdb", False):
        return None
    if config.getoption("collectonly", False) or not _whole_suite(config):
        return None
    raw = os.environ.get(WORKERS_VAR, "").strip()
    try:
        workers = int(raw) if raw else (2 if (os.cpu_count() or 1) >= 2 else 1)
    except ValueError:
        raise pytest.UsageError(f"{WORKERS_VAR}={raw!r}: expected a whole number of workers (1: none)")
    if not raw and os.environ.get("GEAR_MPI_TEST_MPI", "mpich").strip().lower() == "openmpi":
        workers = 1  # every test's jobs under Open MPI: a failed job's clean-up removes session folders by age
    if workers > 1:
        config.option.numprocesses = workers
        config.option.dist = "loadfile"  # what the scheduler below refines
        config.stash[_GROUPED] = True
    return None


_GROUPED = pytest.StashKey[bool]()
#: seconds each of the slowest files took in one process (``--durations=0`` at 3ca5ae7, 2 cores): the scheduler
#: hands out the costliest work first, so that no long file starts last and runs alone at the end; a file not
#: listed counts 0.1 s a test. Only the order depends on these figures.
FILE_SECONDS = {"test_faults.py": 118, "test_parallel_mpi.py": 72, "test_checkpoint.py": 60, "test_openmpi.py": 58,
                "test_replay_mpi.py": 48, "test_example_online_dqn.py": 47, "test_device_path.py": 46,
                "test_example_offline_dt.py": 42, "test_torchrl.py": 36, "test_feeds_mpi.py": 32, "test_slurm.py": 30,
                "test_example_torchrl_dqn.py": 27, "test_file_memory.py": 25, "test_two_hosts.py": 23,
                "test_cuda_kernels.py": 23, "test_writer.py": 20, "test_compressed_shm.py": 17,
                "test_prefetch_mpi.py": 16, "test_datasets.py": 16, "test_compressed.py": 15}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """A whole-suite run's scheduler: a file's tests go to one worker together (its module fixtures are
    built once), and :data:`EXCLUSIVE_FILES` go to one worker one after another."""
    if not config.stash.get(_GROUPED, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "exclusive" if Path(path).name in EXCLUSIVE_FILES else path

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first hand-out: costliest units first
                self.ordered = True

                def cost(unit) -> float:
                    scope, tests = unit
                    if scope == "exclusive":
                        return sum(FILE_SECONDS.get(name, 0.0) for name in EXCLUSIVE_FILES)
                    return FILE_SECONDS.get(Path(scope).name, 0.1 * len(tests))

                units = sorted(self.workqueue.items(), key=cost, reverse=True)
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return FileGroups(config, log)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Record every segment this test process creates; fail if any is still in /dev/shm at the end.

    Only segments created here are checked, so concurrent runs by others on the
    machine cannot make this fail; the check does not garbage-collect first, so
    a shard that a test forgot to close is reported rather than quietly finalised.
    """
    created: list[str] = []
    original = memory.SharedArena.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "owner", False):
            created.append(self.name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory.SharedArena, "__init__", recording_init)
        yield created
    leaked = [n for n in created if os.path.exists(os.path.join(SHM_DIR, n))]
    assert not leaked, f"tests left shared-memory segments behind in {SHM_DIR}: {leaked}"


def traj_spec(max_length: int = 16) -> gm.TrajectorySpec:
    return gm.TrajectorySpec({
        "t": ((), "int64"),             # a unique step number: tells where a window came from
        "obs": ((3, 2), "float32"),
        "act": ((2,), "int16"),
        "done": ((), "bool"),
        "img": ((5,), "uint8"),
    }, max_length=max_length)


class TrajFactory:
    """Random trajectories for :func:`traj_spec`; ``t`` continues across calls (unique steps)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.counter = itertools.count(1)

    def __call__(self, length: int) -> dict[str, np.ndarray]:
        t0 = next(self.counter) * 1_000_000
        done = np.zeros(length, np.bool_)
        done[-1] = True
        return {
            "t": np.arange(t0, t0 + length, dtype=np.int64),
            "obs": self.rng.standard_normal((length, 3, 2)).astype(np.float32),
            "act": self.rng.integers(-30000, 30000, (length, 2)).astype(np.int16),
            "done": done,
            "img": self.rng.integers(0, 256, (length, 5)).astype(np.uint8),
        }


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The calling thread's numba thread count set to 1, then to 2 (at most the pool's), for the test."""
    import numba

    old = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(old)


@pytest.fixture
def spec() -> gm.TrajectorySpec:
    return traj_spec(16)


@pytest.fixture
def make_spec():
    """``make_spec(max_length)``: the same columns with another max_length."""
    return traj_spec


@pytest.fixture
def make_traj() -> TrajFactory:
    return TrajFactory(seed=1234)


@pytest.fixture
def shard_factory():
    """Build shards that are closed at the end of the test (shared memory included)."""
    shards: list[gm.Shard] = []

    def build(*args, **kwargs) -> gm.Shard:
        kwargs.setdefault("tag", 7)
        s = gm.Shard(*args, **kwargs)
        shards.append(s)
        return s

    yield build
    for s in shards:
        s.close()

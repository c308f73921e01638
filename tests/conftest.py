"""Shared fixtures for the gear_mpi test suite.

- ``spec`` / ``make_traj``: a multi-column spec with odd step sizes (bool, int16,
  uint8 columns next to float32 and int64) and a factory of random trajectories whose
  ``t`` column numbers every step uniquely, so a sampled window tells where it came from.
- A session-wide check that every POSIX shared-memory segment created in this
  process (``/dev/shm/gear_mpi_*``) has been unlinked when the tests end.
- ``tests/mpi/`` (pytest modules that every rank of an ``mpiexec`` job runs) is collected
  only when named on the command line; a plain ``pytest tests`` runs them through the
  wrapper tests (tests/test_replay_mpi.py, tests/test_device_path.py) on K ranks instead.
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

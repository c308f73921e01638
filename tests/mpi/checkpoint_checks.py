"""Helpers of the checkpoint modules in tests/mpi: a spec, trajectories known by their id, a
shared directory, and what a shard holds read through its public state methods."""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi import keys as keyspace
from replay_checks import keys_of, same_batch  # noqa: F401 (same_batch: for the checkpoint modules)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "id": ((), "int64"), "flag": ((2,), "uint8")}, max_length=9)


def traj(ident: int) -> dict[str, np.ndarray]:
    """The trajectory with id ``ident``: everything in it follows from the id."""
    rng = np.random.default_rng(ident)
    length = 1 + ident % SPEC.max_length
    return {"obs": rng.standard_normal((length, 3)).astype(np.float32),
            "id": np.full(length, ident, np.int64),
            "flag": rng.integers(0, 256, (length, 2)).astype(np.uint8)}


def fill(replay: gm.Replay, count: int, base: int) -> None:
    ids = [base + 100_000 * replay.rank + i for i in range(count)]
    for j in range(0, len(ids), 5):
        part = ids[j:j + 5]
        replay.insert_many([traj(i) for i in part], [0.25 + (i % 11) for i in part])


def drive(replay: gm.Replay, steps: int, seed: int) -> list:
    """Samples and updates, identical on every call with the same replay state; returns the batches."""
    rng = np.random.default_rng(seed + replay.rank)
    out = []
    for i in range(steps):
        b = replay.sample(3 + replay.rank, 4, ("random", "head", "tail")[i % 3])
        out.append(b)
        replay.update_priorities(keys_of(b), rng.uniform(0.0, 3.0, len(b)))
    return out


def rows(shard: gm.Shard) -> dict[str, np.ndarray]:
    """The shard's table rows by name (indexed by slot), copied from :meth:`Shard.sections`."""
    out: dict[str, np.ndarray] = {}
    for name, arr in shard.sections():
        out.setdefault(name, np.array(arr))
    return out


def slot_of(key: int) -> int:
    return int(keyspace.decode(np.array([key], np.int64))[3][0])


@pytest.fixture
def shared_dir():
    """A fresh directory every rank sees (made by rank 0), removed afterwards."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="gear_ckpt_") if RANK == 0 else None)
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def sub_comm(ranks: int):
    """A communicator of world ranks ``0 .. ranks-1`` (None on the others)."""
    sub = COMM.Split(0 if RANK < ranks else MPI.UNDEFINED, RANK)
    return None if sub == MPI.COMM_NULL else sub


def path_in(base: str, name: str) -> str:
    return os.path.join(base, name)

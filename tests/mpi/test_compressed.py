"""Compressed columns on K ranks: a replay with a compressed column samples exactly what its uncompressed twin does.

Run by tests/test_compressed.py on 1 and 2 ranks; by hand:
``mpiexec -n 2 python -m pytest tests/mpi/test_compressed.py``. Two replays built with the same arguments and
seed (one declares ``pixels`` :class:`gear_mpi.Compressed`) get the same inserts and priority updates; every
batch (windows, mask, probabilities, weights, lengths) must be identical, with rings that wrap many times,
windows across chunk and ring boundaries, and remote windows through MPI (private memory) or through the node
(``shm``: peers still get compressed windows by MPI), in both sampling modes; then a checkpoint of the
compressed replay reloads (same ranks) into batches identical to the twin's again.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
COLUMNS = {"pixels": ((7, 6), "uint8"), "reward": ((), "float32")}


def twin_specs(chunk):
    comp = dict(COLUMNS, pixels=COLUMNS["pixels"] + (gm.Compressed(level=1, chunk=chunk),))
    return gm.TrajectorySpec(COLUMNS, max_length=9), gm.TrajectorySpec(comp, max_length=9)


def trajectories(seed: int, n: int):
    rng = np.random.default_rng([seed, RANK])
    for _ in range(n):
        length = int(rng.integers(1, 10))
        yield {"pixels": (rng.random((length, 7, 6)) < 0.1).astype(np.uint8) * rng.integers(0, 255, (length, 7, 6),
                                                                                             dtype=np.uint8),
               "reward": rng.standard_normal(length).astype(np.float32)}, float(rng.random() + 0.1)


def same_batch(a: gm.Batch, b: gm.Batch) -> None:
    for name in COLUMNS:
        assert np.array_equal(a[name].numpy(), b[name].numpy()), name
    for field in ("mask", "probabilities", "weights", "lengths"):
        assert np.array_equal(getattr(a, field).numpy(), getattr(b, field).numpy()), field


@pytest.mark.parametrize("memory,mode,chunk", [("private", "decentralized", 4), ("private", "centralized", None),
                                               ("shm", "decentralized", 3)])
def test_twin_replays_sample_identical_batches(memory, mode, chunk, force, tmp_path_factory):
    raw_spec, comp_spec = twin_specs(chunk)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), mode=mode, memory=memory, seed=11, force_alltoallv=force)
    raw, comp = gm.Replay(raw_spec, 50, **kw), gm.Replay(comp_spec, 50, **kw)
    try:
        for i, (traj, p) in enumerate(trajectories(3, 40)):
            raw.insert(traj, p)
            comp.insert(traj, p)
            if i % 4 != 3:
                continue
            for align, window in (("random", 4), ("head", 9), ("tail", 6)):
                a, b = raw.sample(5 + RANK, window, align), comp.sample(5 + RANK, window, align)
                same_batch(a, b)
                new = np.linspace(0.5, 2.0, len(a))
                raw.update_priorities(a.keys, new)
                comp.update_priorities(b.keys, new)
        assert comp.shard.stored_bytes() < raw.shard.stored_bytes() + 2 * 9 * 42
        if memory == "private":  # a checkpoint of the compressed replay loads back (same ranks), chunks as saved
            path = COMM.bcast(str(tmp_path_factory.mktemp("ck") / "ck") if RANK == 0 else None)
            comp.save(path)
            comp.close()
            comp, _ = gm.Replay.load(path, force_alltoallv=force)
            for align, window in (("random", 4), ("tail", 6)):
                same_batch(raw.sample(4, window, align), comp.sample(4, window, align))
    finally:
        raw.close()
        comp.close()

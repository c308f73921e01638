"""Compressed columns under memory="shm" on K ranks: node peers decode the owner's chunks from shared memory.

Run by tests/test_compressed_shm.py on 2 and 4 ranks; by hand:
``mpiexec -n 2 python -m mpi4py -m pytest tests/mpi/test_compressed_shm.py``. A compressed replay under ``shm``
reads its node peers' windows in place (no window crosses MPI: ``windows_mpi`` stays 0), decoding the owner's
chunks itself; every batch equals an uncompressed twin's bit for bit (rings that wrap many times between samples,
so owners overwrite chunks peers read in the sample before; windows across chunk and ring boundaries; frames
stored once with their stacks from a compressed frame column), and the draws follow ``p**alpha / sum`` exactly
(chi-square over every rank's draws, fixed seeds), each drawn row holding its own trajectory's pixels.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
import twin_replays

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
COLUMNS = {"pixels": ((7, 6), "uint8"), "ident": ((), "int64")}


def twin_specs(chunk):
    return twin_replays.twin_specs(COLUMNS, chunk)


def pixels_of(ident: int, length: int) -> np.ndarray:
    """Pixels that say which trajectory and step they are (and compress: mostly zeros)."""
    rng = np.random.default_rng(ident)
    px = (rng.random((length, 7, 6)) < 0.2).astype(np.uint8) * rng.integers(1, 255, (length, 7, 6), dtype=np.uint8)
    px[:, 0, 0] = ident % 251
    px[:, 0, 1] = np.arange(length)
    return px


def trajectories(seed: int, n: int):
    rng = np.random.default_rng([seed, RANK])
    for i in range(n):
        ident = 100_000 * RANK + 1000 * seed + i
        length = int(rng.integers(1, 10))
        yield {"pixels": pixels_of(ident, length), "ident": np.full(length, ident, np.int64)}, float(rng.random() + .1)


def same_batch(a: gm.Batch, b: gm.Batch, names=COLUMNS) -> None:
    twin_replays.same_batch(a, b, names=names, keys="untagged")


def windows_crossed(replay) -> int:
    return int(COMM.allreduce(replay.windows_mpi))


@pytest.mark.parametrize("mode,chunk", [("decentralized", 3), ("centralized", 4)])
def test_shm_twins_sample_identical_batches(mode, chunk):
    raw_spec, comp_spec = twin_specs(chunk)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), mode=mode, seed=11, memory="shm")
    raw, comp = gm.Replay(raw_spec, 50, **kw), gm.Replay(comp_spec, 50, **kw)
    try:
        assert len(comp.node.peer_chunks) == comp.node.size - 1  # every node peer's chunks mapped
        # 48 inserts of ~5 steps: the 50-step rings wrap
        twin_replays.feed_and_compare(raw, comp, trajectories(3, 48), COLUMNS, RANK)
        assert windows_crossed(comp) == 0  # the node's windows were read in place, compressed ones included
        if SIZE > 1:
            assert int(COMM.allreduce(comp.windows_shared)) > 0
    finally:
        raw.close()
        comp.close()


def test_forced_alltoallv_still_matches():
    """``force_alltoallv=True``: the owners decode and send (the path shm used before), same batches."""
    raw_spec, comp_spec = twin_specs(3)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), seed=5, memory="shm", force_alltoallv=True)
    raw, comp = gm.Replay(raw_spec, 40, **kw), gm.Replay(comp_spec, 40, **kw)
    try:
        assert not comp.node.peer_chunks
        for traj, p in trajectories(4, 20):
            raw.insert(traj, p)
            comp.insert(traj, p)
        for _ in range(3):
            same_batch(raw.sample(6, 5, "random"), comp.sample(6, 5, "random"))
        assert SIZE == 1 or windows_crossed(comp) > 0
    finally:
        raw.close()
        comp.close()


FRAMES = {"frame": ((5, 4), "uint8"), "ep": ((), "int64"),
          "obs": gm.FrameStack("frame", 4, "first"), "next_obs": gm.NextStep("obs"),
          "zobs": gm.FrameStack("frame", 3, "zeros")}


def test_frames_from_shared_compressed_chunks():
    """Stacks and next observations rebuilt by a node peer from the owner's compressed frame chunks."""
    raw_spec = gm.TrajectorySpec(FRAMES, max_length=20)
    comp_spec = gm.TrajectorySpec(dict(FRAMES, frame=((5, 4), "uint8", gm.Compressed(chunk=3))), max_length=20)
    kw = dict(sampler=gm.Prioritized(0.6, 0.4), seed=21, memory="shm")
    raw, comp = gm.Replay(raw_spec, 90, **kw), gm.Replay(comp_spec, 90, **kw)
    names = ("frame", "ep", "obs", "next_obs", "zobs")
    try:
        rng = np.random.default_rng([8, RANK])
        for i in range(30):
            n = int(rng.integers(2, 15))
            ep = {"frame": rng.integers(0, 256, (n, 5, 4), dtype=np.uint8), "ep": np.full(n, 1000 * RANK + i)}
            p = float(rng.random() + 0.1)
            raw.insert(ep, p)
            comp.insert(ep, p)
            if i % 5 == 4:
                for window in (1, 3):
                    same_batch(raw.sample(4 + RANK, window), comp.sample(4 + RANK, window), names)
        assert windows_crossed(comp) == 0
    finally:
        raw.close()
        comp.close()


@pytest.mark.parametrize("mode", ["decentralized", "centralized"])
def test_draws_are_exact_and_rows_hold_their_trajectory(mode):
    """Chi-square of every rank's draws against p**alpha / sum (fixed seeds, significance 1e-3); every drawn
    row's pixels are its own trajectory's steps, decoded from its owner's shared chunks."""
    _, comp_spec = twin_specs(4)
    sel = gm.Prioritized(0.8, 0.4)
    comp = gm.Replay(comp_spec, 400, sel, mode=mode, seed=17, memory="shm")
    try:
        held = {}
        for traj, p in trajectories(6, 10 + 6 * RANK):  # uneven shards
            key = comp.insert(traj, p)
            held[key] = (p, int(traj["ident"][0]), len(traj["ident"]))
        everyone = {k: v for part in COMM.allgather(held) for k, v in part.items()}
        drawn = []
        for _ in range(50):
            b = comp.sample(30 + 5 * RANK, 2, "head")
            keys = b.meta_numpy()[0].tolist()
            drawn.extend(keys)
            px, mask = b.numpy()["pixels"], b.mask_numpy()
            for row, key in enumerate(keys):
                _, ident, length = everyone[key]
                n = int(mask[row].sum())
                assert n == min(2, length)
                assert np.array_equal(px[row, :n], pixels_of(ident, length)[:n]), (key, ident)
        parts = COMM.gather(drawn, root=0)
        assert windows_crossed(comp) == 0
    finally:
        comp.close()
    if RANK == 0:
        from scipy.stats import chisquare
        keys = sorted(everyone)
        w = np.array([everyone[k][0] ** sel.alpha for k in keys])
        index = {k: i for i, k in enumerate(keys)}
        counts = np.bincount([index[k] for part in parts for k in part], minlength=len(keys))
        p = float(chisquare(counts, w / w.sum() * counts.sum()).pvalue)
        assert p > 1e-3, (mode, p)


def test_checkpoint_of_a_shared_chunk_replay_loads_into_shared_chunks(tmp_path_factory):
    """save / load of a shm replay with compressed columns: chunks saved as stored, loaded into the new shards'
    shared tables (node peers read them again), batches equal to the raw twin's."""
    raw_spec, comp_spec = twin_specs(3)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), seed=9, memory="shm")
    raw, comp = gm.Replay(raw_spec, 50, **kw), gm.Replay(comp_spec, 50, **kw)
    try:
        for traj, p in trajectories(12, 30):
            raw.insert(traj, p)
            comp.insert(traj, p)
        path = COMM.bcast(str(tmp_path_factory.mktemp("ck") / "ck") if RANK == 0 else None)
        comp.save(path)
        comp.close()
        comp, _ = gm.Replay.load(path, memory="shm")
        assert comp.shard.store.compressed["pixels"].shared == "owner"
        assert len(comp.node.peer_chunks) == comp.node.size - 1
        for align, window in (("random", 4), ("tail", 6)):
            same_batch(raw.sample(4 + RANK, window, align), comp.sample(4 + RANK, window, align))
        assert windows_crossed(comp) == 0
    finally:
        raw.close()
        comp.close()

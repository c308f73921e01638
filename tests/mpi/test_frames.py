"""Frames stored once on K ranks: a Replay's FrameStack / NextStep columns equal a naive reconstruction.

Run by tests/test_frame_stack.py on 2 ranks (``--force-alltoallv``: each remote owner sends its
windows' context frames through MPI and the requester rebuilds; otherwise the requester reads the
node peer's ring). By hand: ``mpiexec -n 2 python -m pytest tests/mpi/test_frames.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from twin_replays import flip_a_byte

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
FRAME = (4, 3)
SPEC = gm.TrajectorySpec({"frame": (FRAME, "uint8"), "t": ((), "int64"), "ep": ((), "int64"),
                          "obs": gm.FrameStack("frame", 4, "first"), "next_obs": gm.NextStep("obs"),
                          "zobs": gm.FrameStack("frame", 3, "zeros")}, max_length=30)
#: the same with the frame column compressed (chunks of 3): stacks and the frame column from decoded chunks
COMPRESSED = gm.TrajectorySpec({"frame": (FRAME, "uint8", gm.Compressed(chunk=3)), "t": ((), "int64"),
                                "ep": ((), "int64"), "obs": gm.FrameStack("frame", 4, "first"),
                                "next_obs": gm.NextStep("obs"), "zobs": gm.FrameStack("frame", 3, "zeros")},
                               max_length=30)


def episode(ident: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(ident)
    n = 2 + ident % 17
    return {"frame": rng.integers(0, 256, (n,) + FRAME, dtype=np.uint8), "t": np.arange(n, dtype=np.int64),
            "ep": np.full(n, ident, np.int64)}


def stack(frames, t, depth, pad):
    return np.stack([frames[s] if s >= 0 else (frames[0] if pad == "first" else np.zeros_like(frames[0]))
                     for s in range(t - depth + 1, t + 1)])


@pytest.mark.parametrize("mode", ["decentralized", "centralized"])
@pytest.mark.parametrize("window,align,spec", [(1, "random", SPEC), (4, "random", SPEC), (6, "tail", SPEC),
                                               (1, "random", COMPRESSED), (4, "tail", COMPRESSED)])
def test_replay_frames_match_naive(mode, window, align, spec, force):
    replay = gm.Replay(spec, 300, gm.Prioritized(0.6, 0.4), mode=mode, seed=11, timeout=60, force_alltoallv=force)
    try:
        idents = [1000 * RANK + i for i in range(20)]
        for i in idents:
            replay.insert(episode(i), priority=1.0 + i % 5)
        for _ in range(3):
            b = replay.sample(24 + 8 * RANK, window, align)
            d, mask = b.numpy(), b.mask_numpy()
            owners = set()
            for i in range(mask.shape[0]):
                for j in range(mask.shape[1]):
                    if not mask[i, j]:
                        assert not d["obs"][i, j].any() and not d["zobs"][i, j].any()
                        continue
                    ep, t = int(d["ep"][i, j]), int(d["t"][i, j])
                    owners.add(ep // 1000)
                    frames = episode(ep)["frame"]
                    assert t < len(frames) - 1
                    np.testing.assert_array_equal(d["frame"][i, j], frames[t])
                    np.testing.assert_array_equal(d["obs"][i, j], stack(frames, t, 4, "first"))
                    np.testing.assert_array_equal(d["next_obs"][i, j], stack(frames, t + 1, 4, "first"))
                    np.testing.assert_array_equal(d["zobs"][i, j], stack(frames, t, 3, "zeros"))
            if SIZE > 1:
                assert len(owners) > 1  # windows of other ranks' episodes were rebuilt here
    finally:
        replay.close()


@pytest.mark.parametrize("window", [1, 4])
def test_stacks_from_a_damaged_chunk_fail_on_every_rank(window, force):
    """The last rank's compressed frame chunks have a flipped byte each. Frame stacks rebuilt from them --
    by the owner packing context windows it sends, or by a rank reading them directly -- fail the sample on
    every rank with the same CorruptDataError, and the replay goes on."""
    replay = gm.Replay(COMPRESSED, 300, gm.Uniform(), seed=11, timeout=20, force_alltoallv=force)
    try:
        for i in range(12):
            replay.insert(episode(1000 * RANK + i))
        if RANK == SIZE - 1:
            ring = replay.shard.store.compressed["frame"]
            for j, c in enumerate(ring.chunks):
                if c is not None:  # in place, in process or node-shared memory (peers decode it too)
                    flip_a_byte(ring, j)
        failed = None
        for i in range(30):
            try:
                replay.sample(16, window)
            except gm.CorruptDataError as e:
                failed = (i, str(e))
                break
        every = COMM.allgather(failed)
        assert every[0] is not None and all(f == every[0] for f in every), every
        assert "column 'frame'" in every[0][1] and "CRC-32" in every[0][1], every[0]
        assert replay.stats()["total"]["items"] > 0  # a collective: every rank is still in step
    finally:
        replay.close()

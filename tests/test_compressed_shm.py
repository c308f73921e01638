"""Compressed columns under memory="shm" (node peers decode the owner's chunks: gear_mpi/storage/shared_chunks.py),
and the single-shard archive (gm.save_shard / load_shard) of compressed columns; the multi-rank module
tests/mpi/test_compressed_shm.py on 2 and 4 ranks (twin Replays bit-exact, chi-square exact draws)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import arenas, compressed as compressed_module, shared_chunks
from mpi_util import run_pytest_mpi

SPEC = gm.TrajectorySpec({"pixels": ((6, 5), "uint8", gm.Compressed(chunk=3)), "r": ((), "float32")},
                         max_length=9)
RAW = gm.TrajectorySpec({"pixels": ((6, 5), "uint8"), "r": ((), "float32")}, max_length=9)


def trajectory(rng):
    n = int(rng.integers(1, 10))
    px = ((rng.random((n, 6, 5)) < 0.3) * rng.integers(0, 200, (n, 6, 5))).astype(np.uint8)
    return {"pixels": px, "r": rng.random(n).astype(np.float32)}


def windows(shard, b, window, rng):
    """b windows of live trajectories: ring starts, real steps, padding, rows (as a sample places them)."""
    slots = shard.store.live_slots()
    pick = slots[rng.integers(0, len(slots), b)]
    start = shard.store.start[pick].astype(np.int64)
    valid = np.minimum(shard.store.length[pick].astype(np.int64), window)
    return start, valid, np.zeros(b, np.int64), np.arange(b, dtype=np.int64)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_peer_decodes_the_owners_shared_chunks(monkeypatch, kernels):
    """A PeerChunks mapping of a shm shard's chunk files reads what the owner reads, bit for bit, through laps
    of the ring (chunks sealed, reopened, freed); compiled and Python decoding paths."""
    monkeypatch.setattr(compressed_module, "USE_KERNELS", kernels)
    rng = np.random.default_rng(3)
    with gm.Shard(SPEC, 40, memory="shm", seed=1) as owner:
        ring = owner.store.compressed["pixels"]
        name = shared_chunks.segment_name(owner.shm_name, 0)
        assert ring.shared == "owner" and os.path.exists(os.path.join(arenas.SHM_DIR, name))
        _, views = gm.attach_columns(owner.shm_name, SPEC, 40)
        peer = shared_chunks.PeerChunks(SPEC, 40, owner.shm_name, views, owner=0)
        try:
            for lap in range(12):
                for _ in range(3):
                    owner.insert(trajectory(rng))
                args = windows(owner, 16, 5, rng)
                mine, theirs = np.zeros(16 * 5 * 30, np.uint8), np.ones(16 * 5 * 30, np.uint8)
                owner.store.gather_compressed(*args, {"pixels": mine}, 5)
                peer.gather_compressed(*args, {"pixels": theirs}, 5)
                assert np.array_equal(mine, theirs), lap
                assert peer.compressed["pixels"].open_index == ring.open_index
        finally:
            peer.close()


@pytest.mark.parametrize("memory", ["file", "shm"])
def test_a_small_chunk_log_keeps_its_chunks_through_many_laps(tmp_path, memory):
    """A chunk log of one or two blocks (a small ring): freeing the oldest chunks gives back only blocks that hold
    no newer chunk (the log wraps within a block; it used to punch the newest chunks out: CRC errors on insert)."""
    rng = np.random.default_rng(3)
    a = gm.Shard(RAW, 40, seed=1, tag=1)
    b = gm.Shard(SPEC, 40, seed=1, tag=1, memory=memory, **({"path": str(tmp_path)} if memory == "file" else {}))
    try:
        for _ in range(60):
            t = trajectory(rng)
            a.insert(t)
            b.insert(t)
        for _ in range(3):
            assert np.array_equal(a.sample(8, 9, "head")["pixels"].numpy(), b.sample(8, 9, "head")["pixels"].numpy())
    finally:
        a.close()
        b.close()


def test_chunks_saved_with_another_default_chunking_load_into_a_shared_table():
    """A checkpoint of the older default chunking (``chunk=None``): a shared table keeps its geometry (peers mapped
    it), so the saved chunks are decoded and compressed again; the steps read back the same."""
    spec = gm.TrajectorySpec({"pixels": ((6, 5), "uint8", gm.Compressed())}, max_length=9)
    rng = np.random.default_rng(2)
    with gm.Shard(spec, 40, memory="shm") as s:
        ring = s.store.compressed["pixels"]
        old = compressed_module.CompressedRing(spec["pixels"], 40)
        old._set_k(2 if ring.k != 2 else 4)
        data = (rng.random((40, 6, 5)) < 0.3).astype(np.uint8) * 7
        old.write(0, data[:37])
        ring.restore(old.export())
        assert ring.k != old.k and ring.shared == "owner"
        assert np.array_equal(ring.read_steps(np.arange(37)), data[:37])


def test_a_corrupted_shared_chunk_names_owner_column_and_chunk():
    rng = np.random.default_rng(4)
    with gm.Shard(SPEC, 40, memory="shm", seed=1) as owner:
        for _ in range(6):
            owner.insert(trajectory(rng))
        ring = owner.store.compressed["pixels"]
        j = int(np.flatnonzero(ring.size >= 0)[0])
        _, views = gm.attach_columns(owner.shm_name, SPEC, 40)
        peer = shared_chunks.PeerChunks(SPEC, 40, owner.shm_name, views, owner=3)
        try:
            ring.chunks[j][5] ^= 0x10  # a flipped byte in shared memory
            out = np.zeros(30 * 3, np.uint8)
            one = np.array([j * ring.k], np.int64)
            with pytest.raises(gm.CorruptDataError, match=rf"column 'pixels'.*compressed chunk {j} .*rank 3's shard"):
                peer.gather_compressed(one, np.array([3]), np.zeros(1, np.int64), np.zeros(1, np.int64),
                                       {"pixels": out}, 3, np.array([77]))
        finally:
            peer.close()


def test_replay_names_are_gone_once_peers_mapped():
    """A Replay unlinks its chunk files' names with its segment's (a crash leaves nothing in /dev/shm)."""
    replay = gm.Replay(SPEC, 30, memory="shm", seed=2)
    try:
        ring = replay.shard.store.compressed["pixels"]
        assert ring.shared == "owner" and not os.path.exists(ring.heap.filename)
        replay.insert(trajectory(np.random.default_rng(1)))
        assert replay.sample(2, 3)["pixels"].shape == (2, 3, 6, 5)
    finally:
        replay.close()


@pytest.mark.parametrize("memory", ["private", "shm"])
def test_save_shard_keeps_compressed_chunks(tmp_path, memory):
    """gm.save_shard / load_shard of compressed columns: chunks saved as stored, the loaded shard samples what the
    saved one would (same windows as its uncompressed twin); a flipped byte fails the load naming the column."""
    rng = np.random.default_rng(9)
    a, b = gm.Shard(RAW, 40, seed=5, tag=1), gm.Shard(SPEC, 40, seed=5, tag=1, memory=memory)
    try:
        for _ in range(14):
            t = trajectory(rng)
            a.insert(t)
            b.insert(t)
        gm.save_shard(b, tmp_path / "s.npz")
        with np.load(tmp_path / "s.npz") as f:
            assert "compressed/0/heap" in f.files and "column/0" not in f.files
            assert f["compressed/0/heap"].nbytes == b.store.compressed["pixels"].stored_bytes  # as stored
        back = gm.load_shard(tmp_path / "s.npz", memory=memory)
        try:
            for _ in range(4):
                x, y = a.sample(6, 5), back.sample(6, 5)
                assert np.array_equal(x["pixels"].numpy(), y["pixels"].numpy())
                assert np.array_equal(x["r"].numpy(), y["r"].numpy())
        finally:
            back.close()
        arrays = dict(np.load(tmp_path / "s.npz"))
        arrays["compressed/0/heap"] = arrays["compressed/0/heap"].copy()
        arrays["compressed/0/heap"][-2] ^= 0x01
        with pytest.raises(gm.CheckpointError, match=r"column 'pixels'.*CRC-32"):
            gm.shard_from_arrays(arrays)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("ranks", [2, 4])
def test_shm_replays_on_two_and_four_ranks(ranks):
    """tests/mpi/test_compressed_shm.py: node peers decode each other's chunks; twins bit-exact, draws exact."""
    run = run_pytest_mpi(ranks, "test_compressed_shm.py", timeout=400)
    assert len(run.passed(0)) == 7, run.passed(0)

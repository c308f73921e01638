"""Compressed columns with file memory and mapped checkpoints (one process; real files).

- ``memory="file"``: the sealed chunks live in a sparse log file of the shard's (storage/chunk_heap.py),
  unlinked at once; a file-backed compressed Shard draws the very batches a private raw twin does, through
  many laps of the ring; the file's blocks stay near the compressed bytes held (holes behind the log's head);
  a full disk raises StorageError before an insert changes anything; clear() gives every block back.
- ``Replay.load(mmap=True)``: the chunks stay in the mapped ``compressed.bin`` (views, no copy, no CRC pass),
  samples equal the saved replay's, inserts never write the file, a flipped byte is caught when a window
  reads its chunk (verify=False) or at load (verify=True), a truncation is caught by the guard.
- A copying load into ``memory="file"`` puts the saved chunks into the new shard's files.
"""
from __future__ import annotations

import errno
import hashlib
import os

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.errors import CheckpointError, StorageError
from gear_mpi.storage import chunk_heap

RAW = {"pixels": ((6, 5), "uint8"), "r": ((), "float32")}


def spec(chunk=3, compressed=True):
    cols = dict(RAW, pixels=RAW["pixels"] + (gm.Compressed(level=1, chunk=chunk),)) if compressed else RAW
    return gm.TrajectorySpec(cols, max_length=9)


def trajectory(rng):
    n = int(rng.integers(1, 10))
    pixels = ((rng.random((n, 6, 5)) < 0.3) * rng.integers(0, 9, (n, 6, 5))).astype(np.uint8)
    return {"pixels": pixels, "r": rng.random(n).astype(np.float32)}


def same(a: gm.Batch, b: gm.Batch) -> None:
    for name in ("pixels", "r", "mask", "probabilities", "weights"):
        x = a[name] if name in RAW else getattr(a, name)
        y = b[name] if name in RAW else getattr(b, name)
        assert np.array_equal(x.numpy(), y.numpy()), name


def sha(filename: str) -> str:
    return hashlib.sha256(open(filename, "rb").read()).hexdigest()


def test_file_backed_chunks_sample_as_a_private_raw_twin_and_stay_compressed_on_disk(tmp_path):
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), seed=4, tag=1)
    raw = gm.Shard(spec(compressed=False), 60, **kw)
    comp = gm.Shard(spec(), 60, memory="file", path=str(tmp_path), **kw)
    heap = comp.store.compressed["pixels"].heap
    assert isinstance(heap, chunk_heap.FileChunkHeap)
    assert sorted(os.listdir(tmp_path / "rank-00000")) == ["columns.bin"]  # the chunks' file is unlinked already
    rng = np.random.default_rng(1)
    for i in range(150):  # about 11 laps of the ring
        t = trajectory(rng)
        assert raw.insert(t, 1.0 + i % 5) == comp.insert(t, 1.0 + i % 5)
        if i % 10 == 0:
            for align, window in (("random", 4), ("head", 9), ("tail", 2)):
                same(raw.sample(6, window, align), comp.sample(6, window, align))
    ring = comp.store.compressed["pixels"]
    assert heap.held_bytes == ring.stored_bytes > 0
    blocks = os.fstat(heap._fd).st_blocks * 512
    assert blocks <= heap.held_bytes + 3 * chunk_heap.BLOCK, (blocks, heap.held_bytes)  # holes behind the head
    assert heap.tail > 2 * heap.span  # the log went round its file several times
    for key in comp.live_keys()[:5].tolist():
        assert np.array_equal(comp.get(key)["pixels"], raw.get(key)["pixels"])
    comp.clear()
    assert heap.held_bytes == 0 and os.fstat(heap._fd).st_blocks * 512 <= chunk_heap.BLOCK
    comp.close()
    raw.close()
    assert not (tmp_path / "rank-00000").exists()


def test_a_full_disk_raises_before_an_insert_changes_anything(tmp_path, monkeypatch):
    big_spec = gm.TrajectorySpec({"pixels": ((64, 64), "uint8", gm.Compressed(level=1, chunk=1)),
                                  "r": ((), "float32")}, max_length=9)  # a chunk of 4 KiB: reserved block by block
    shard = gm.Shard(big_spec, 40, memory="file", path=str(tmp_path), seed=2)
    rng = np.random.default_rng(3)
    for _ in range(12):
        n = int(rng.integers(1, 10))
        shard.insert({"pixels": rng.integers(0, 4, (n, 64, 64)).astype(np.uint8), "r": np.ones(n, np.float32)})
    before = shard.sample(8, 9, "head")
    keys, used = shard.live_keys().copy(), shard.store.steps_used

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    big = {"pixels": rng.integers(0, 255, (9, 64, 64)).astype(np.uint8), "r": np.zeros(9, np.float32)}
    with pytest.raises(StorageError, match="not enough disk for the compressed chunks"):
        shard.insert(big)
    assert np.array_equal(shard.live_keys(), keys) and shard.store.steps_used == used
    for key in keys.tolist():  # every trajectory reads back whole: no chunk was touched
        assert shard.get(key)["pixels"].shape[0] == shard.get(key)["r"].shape[0]
    monkeypatch.undo()
    shard.insert(big)  # room again: the insert goes through
    assert shard.get(int(shard.live_keys()[-1]))["pixels"].tobytes() == big["pixels"].tobytes()
    assert before.keys.numpy().size == 8
    shard.close()


def test_the_log_survives_frees_out_of_order_and_says_when_full(tmp_path):
    heap = chunk_heap.FileChunkHeap(str(tmp_path), "chunks-000.bin", n_chunks=3, chunk_bytes=1000)
    try:
        assert not os.path.exists(tmp_path / "chunks-000.bin")
        views = {j: heap.store(j, bytes([j + 1]) * 900) for j in range(3)}
        heap.free(1)  # out of order: its bytes are reclaimed once the older ones go
        assert heap.head == 0 and heap.held_bytes == 1800
        views[3] = heap.store(3, b"\x07" * 1000)
        assert bytes(views[0][:3]) == b"\x01\x01\x01" and bytes(views[2][-2:]) == b"\x03\x03"
        heap.free(0)
        assert heap.head == views_pos(heap, 2)
        with pytest.raises(StorageError, match="full of chunks freed out of order"):
            for j in range(4, 40):
                heap.store(j, b"\x09" * 1032)
                heap.free(j - 1) if j % 2 else None
    finally:
        heap.close()


def views_pos(heap, j):
    return heap._at[j][1]


def saved(tmp_path, memory="file"):
    """A compressed replay (and its raw twin) with the same inserts and seed, both saved at the same point."""
    kw = dict(sampler=gm.Prioritized(0.6, 0.4), seed=9)
    raw = gm.Replay(spec(compressed=False), 50, memory="private", **kw)
    comp = gm.Replay(spec(), 50, memory=memory, **({"path": str(tmp_path)} if memory == "file" else {}), **kw)
    rng = np.random.default_rng(5)
    for i in range(30):
        t = trajectory(rng)
        raw.insert(t, 0.5 + i % 3)
        comp.insert(t, 0.5 + i % 3)
    raw.save(str(tmp_path / "raw"))
    comp.save(str(tmp_path / "comp"))
    raw.close()
    comp.close()
    return str(tmp_path / "raw"), str(tmp_path / "comp")


def test_a_mapped_load_leaves_the_chunks_in_the_file_and_samples_as_saved(tmp_path):
    raw_path, comp_path = saved(tmp_path)
    name = os.path.join(comp_path, "rank-00000", "compressed.bin")
    digest = sha(name)
    raw, _ = gm.Replay.load(raw_path)
    comp, _ = gm.Replay.load(comp_path, mmap=True)
    try:
        ring = comp.shard.store.compressed["pixels"]
        sealed = [c for c in ring.chunks if c is not None]
        assert sealed and all(isinstance(c, np.ndarray) and not c.flags.owndata for c in sealed)  # views: no copy
        for _ in range(5):
            same(raw.sample(7, 5), comp.sample(7, 5))
        rng = np.random.default_rng(8)
        for _ in range(20):  # chunks reopened and sealed again: in this process, never in the file
            t = trajectory(rng)
            raw.insert(t)
            comp.insert(t)
        same(raw.sample(7, 9, "head"), comp.sample(7, 9, "head"))
        assert sha(name) == digest
        gm.checkpoint.verify(comp_path)
    finally:
        raw.close()
        comp.close()


def test_a_mapped_load_catches_a_flipped_byte_when_read_and_a_truncation_by_its_guard(tmp_path):
    _, comp_path = saved(tmp_path)
    name = os.path.join(comp_path, "rank-00000", "compressed.bin")
    data = bytearray(open(name, "rb").read())
    data[-3] ^= 0x40  # in the last sealed chunk
    with open(name, "r+b") as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointError, match="compressed.bin"):
        gm.Replay.load(comp_path, mmap=True, verify=True)
    comp, _ = gm.Replay.load(comp_path, mmap=True)  # verify=False: not read at load
    try:
        with pytest.raises(gm.CorruptDataError, match="column 'pixels'.*CRC-32"):
            for _ in range(40):
                comp.sample(8, 9, "head")
    finally:
        comp.close()
    data[-3] ^= 0x40
    with open(name, "wb") as f:
        f.write(bytes(data))
    comp, _ = gm.Replay.load(comp_path, mmap=True)
    try:
        comp.sample(4, 3)
        os.truncate(name, 10)  # another process cuts the mapped file: the next call says so, no SIGBUS
        with pytest.raises(CheckpointError, match="compressed.bin was"):
            comp.sample(4, 3)
    finally:
        comp.close()


@pytest.mark.parametrize("memory", ["private", "file"])
def test_a_copying_load_into_file_memory_puts_the_chunks_in_the_new_files(tmp_path, memory):
    raw_path, comp_path = saved(tmp_path, memory)
    into = tmp_path / "into"
    into.mkdir()
    raw, _ = gm.Replay.load(raw_path)
    comp, _ = gm.Replay.load(comp_path, memory="file", memory_path=str(into))
    try:
        ring = comp.shard.store.compressed["pixels"]
        assert ring.heap is not None and ring.heap.held_bytes == ring.stored_bytes > 0
        for _ in range(4):
            same(raw.sample(6, 4), comp.sample(6, 4))
    finally:
        raw.close()
        comp.close()


@pytest.mark.parametrize("mmap", [False, True])
def test_frames_stored_once_and_compressed_reload_with_their_stacks(tmp_path, mmap):
    """A checkpoint keeps the derived columns (FrameStack, NextStep): it loads, plain or mapped, into the same
    stacks (the load used to drop them and fail on the arena header)."""
    cols = {"frame": ((5, 4), "uint8", gm.Compressed(level=1, chunk=2)), "action": ((), "int64"),
            "obs": gm.FrameStack("frame", 3), "next_obs": gm.NextStep("obs")}
    frames_spec = gm.TrajectorySpec(cols, max_length=9)
    replay = gm.Replay(frames_spec, 60, memory="file", path=str(tmp_path), seed=6)
    rng = np.random.default_rng(2)
    for _ in range(12):
        n = int(rng.integers(2, 10))
        replay.insert({"frame": rng.integers(0, 5, (n, 5, 4)).astype(np.uint8), "action": np.arange(n)})
    replay.save(str(tmp_path / "ck"))
    expect = replay.sample(6, 1)
    replay.close()
    back, _ = gm.Replay.load(str(tmp_path / "ck"), mmap=mmap)
    try:
        assert back.spec == frames_spec
        got = back.sample(6, 1)
        for name in ("obs", "next_obs", "action"):
            assert np.array_equal(expect[name].numpy(), got[name].numpy()), name
    finally:
        back.close()

"""Compressed columns on K ranks: a replay with a compressed column samples exactly what its uncompressed twin does.

Run by tests/test_compressed.py on 1 and 2 ranks; by hand:
``mpiexec -n 2 python -m pytest tests/mpi/test_compressed.py``. Two replays built with the same arguments and
seed (one declares ``pixels`` :class:`gear_mpi.Compressed`) get the same inserts and priority updates; every
batch (windows, mask, probabilities, weights, lengths) must be identical, with rings that wrap many times,
windows across chunk and ring boundaries, and remote windows through MPI (private memory) or through the node
(``shm``: peers still get compressed windows by MPI), in both sampling modes, with the compressed twin's chunks
in process memory or (``memory="file"``) in its shard's files; then a checkpoint of the compressed replay reloads
(same ranks; a file-backed one mapped, ``mmap=True``) into batches identical to the twin's again; prefetched
batches (``batches()``) over a compressed file-backed replay are the raw twin's plain samples.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
import twin_replays
from replay_checks import arrays

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
COLUMNS = {"pixels": ((7, 6), "uint8"), "reward": ((), "float32")}


def twin_specs(chunk):
    return twin_replays.twin_specs(COLUMNS, chunk)


def trajectories(seed: int, n: int):
    rng = np.random.default_rng([seed, RANK])
    for _ in range(n):
        length = int(rng.integers(1, 10))
        yield {"pixels": (rng.random((length, 7, 6)) < 0.1).astype(np.uint8) * rng.integers(0, 255, (length, 7, 6),
                                                                                             dtype=np.uint8),
               "reward": rng.standard_normal(length).astype(np.float32)}, float(rng.random() + 0.1)


def same_batch(a: gm.Batch, b: gm.Batch) -> None:
    twin_replays.same_batch(a, b, names=COLUMNS, keys="untagged")


def shared_dir(tmp_path_factory, name: str) -> str:
    return COMM.bcast(str(tmp_path_factory.mktemp(name)) if RANK == 0 else None)


@pytest.mark.parametrize("memory,mode,chunk", [("private", "decentralized", 4), ("private", "centralized", None),
                                               ("shm", "decentralized", 3), ("file", "decentralized", 3)])
def test_twin_replays_sample_identical_batches(memory, mode, chunk, force, tmp_path_factory):
    raw_spec, comp_spec = twin_specs(chunk)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), mode=mode, seed=11, force_alltoallv=force)
    where = {"path": shared_dir(tmp_path_factory, "shards")} if memory == "file" else {}
    raw = gm.Replay(raw_spec, 50, memory="private" if memory == "file" else memory, **kw)  # file: against private
    comp = gm.Replay(comp_spec, 50, memory=memory, **where, **kw)
    try:
        twin_replays.feed_and_compare(raw, comp, trajectories(3, 40), COLUMNS, RANK)
        assert comp.shard.stored_bytes() < raw.shard.stored_bytes() + 2 * 9 * 42
        if memory != "shm":  # a checkpoint of the compressed replay loads back (same ranks), chunks as saved
            path = COMM.bcast(str(tmp_path_factory.mktemp("ck") / "ck") if RANK == 0 else None)
            comp.save(path)
            comp.close()
            comp, _ = gm.Replay.load(path, force_alltoallv=force, mmap=memory == "file")  # file: chunks mapped
            if memory == "file":
                heap = comp.shard.store.compressed["pixels"].chunks
                assert any(isinstance(c, np.ndarray) for c in heap)  # views of the mapped compressed.bin
            for align, window in (("random", 4), ("tail", 6)):
                same_batch(raw.sample(4, window, align), comp.sample(4, window, align))
    finally:
        raw.close()
        comp.close()


def test_corrupted_checkpoint_chunk_names_column_and_trajectory(tmp_path_factory):
    """A byte flipped in a saved compressed chunk: the load fails on every rank with the column and trajectories."""
    _, comp_spec = twin_specs(4)
    comp = gm.Replay(comp_spec, 50, seed=2, memory="private")
    for traj, p in trajectories(5, 12):
        comp.insert(traj, p)
    path = COMM.bcast(str(tmp_path_factory.mktemp("bad") / "ck") if RANK == 0 else None)
    comp.save(path)
    comp.close()
    if RANK == 0:  # the last bytes of rank 0's compressed.bin are its sealed chunks' bytes
        name = f"{path}/rank-00000/compressed.bin"
        data = bytearray(open(name, "rb").read())
        data[-3] ^= 0x40
        open(name, "wb").write(bytes(data))
    COMM.barrier()
    with pytest.raises(ValueError, match=r"column 'pixels'.*trajectory slot\(s\) \[\d.*corrupted"):
        gm.Replay.load(path)


SAVE_DIR = os.environ.get("GEAR_TEST_COMPRESSED_SAVE")


@pytest.mark.skipif(not SAVE_DIR, reason="started by tests/test_compressed.py with a directory to save into")
def test_save_twins_for_a_resharded_load():
    """Save an uncompressed replay and its compressed twin (the next test loads both onto another rank count)."""
    raw_spec, comp_spec = twin_specs(3)
    for spec, name in ((raw_spec, "raw"), (comp_spec, "comp")):
        replay = gm.Replay(spec, 50, sampler=gm.Prioritized(0.6, 0.4), seed=4, memory="private")
        for traj, p in trajectories(9, 25):
            replay.insert(traj, p)
        replay.save(os.path.join(SAVE_DIR, name))
        replay.close()


@pytest.mark.skipif(not os.environ.get("GEAR_TEST_COMPRESSED_LOAD"), reason="after test_save_twins_for_a_resharded_load")
def test_load_twins_resharded():
    """The twins, saved on another rank count, load resharded holding the same trajectories, bit for bit (their
    ring order follows insertion times, which differ between the twins, so batches are compared by content)."""
    where = os.environ["GEAR_TEST_COMPRESSED_LOAD"]
    held = {}
    shards = os.path.join(where, "shards")
    os.makedirs(shards, exist_ok=True)
    for name in ("raw", "comp"):  # the compressed one into file-backed shards: chunks compressed into their files
        into = {"memory": "file", "memory_path": shards} if name == "comp" else {}
        replay, _ = gm.Replay.load(os.path.join(where, name), capacity_steps=200, **into)
        try:
            contents = [replay.get(int(k)) for k in replay.shard.live_keys()]
            held[name] = sorted((t["reward"].tobytes(), t["pixels"].tobytes()) for t in contents)
            batch = replay.sample(6, 4, "head")
            by_key = {int(k): t for k, t in zip(replay.shard.live_keys(), contents)}
            got = arrays(batch)
            for row, key in enumerate(got["keys"].tolist()):
                n = int(got["mask"][row].sum())
                assert np.array_equal(got["pixels"][row, :n], by_key[key]["pixels"][:n])
        finally:
            replay.close()
    assert held["raw"] == held["comp"] and len(held["raw"]) == 16  # 9 + 7 live on the two saving ranks


def test_get_many_reads_compressed_trajectories_of_every_rank():
    raw_spec, comp_spec = twin_specs(2)
    raw, comp = gm.Replay(raw_spec, 30, seed=1, memory="private"), gm.Replay(comp_spec, 30, seed=1, memory="private")
    try:
        keys_raw, keys_comp = [], []
        for traj, p in trajectories(7, 6):
            keys_raw.append(raw.insert(traj, p))
            keys_comp.append(comp.insert(traj, p))
        everyone_raw = [k for part in COMM.allgather(keys_raw) for k in part]
        everyone_comp = [k for part in COMM.allgather(keys_comp) for k in part]
        for a, b in zip(raw.get_many(everyone_raw), comp.get_many(everyone_comp)):
            assert (a is None) == (b is None)
            if a is not None:
                assert all(np.array_equal(a[n], b[n]) for n in COLUMNS)
    finally:
        raw.close()
        comp.close()


def test_prefetched_batches_over_a_compressed_file_backed_replay(tmp_path_factory):
    """``batches()`` (a background thread samples ahead) over compressed chunks in files: the raw twin's samples."""
    raw_spec, comp_spec = twin_specs(3)
    kw = dict(sampler=gm.Prioritized(0.7, 0.5), seed=13)
    raw = gm.Replay(raw_spec, 60, memory="private", **kw)
    comp = gm.Replay(comp_spec, 60, memory="file", path=shared_dir(tmp_path_factory, "pf"), **kw)
    try:
        for traj, p in trajectories(21, 30):
            raw.insert(traj, p)
            comp.insert(traj, p)
        plain = [raw.sample(4 + RANK, 5, "random") for _ in range(6)]
        with comp.batches(4 + RANK, 5, prefetch=2, limit=6, recycle=False) as it:
            got = list(it)
        assert len(got) == 6
        for a, b in zip(plain, got):
            same_batch(a, b)
    finally:
        raw.close()
        comp.close()


def test_get_many_of_a_damaged_chunk_fails_on_every_rank():
    """The last rank's compressed chunk has a flipped byte: ``get_many`` of one of its trajectories raised
    CorruptDataError on that rank while it packed, and the others waited in the exchange until their timeout
    (the replay broken). Now every rank raises the owner's CorruptDataError at once, and the replay goes on."""
    _, comp_spec = twin_specs(2)
    replay = gm.Replay(comp_spec, 30, seed=1, memory="private", timeout=20.0)
    try:
        keys = [replay.insert(traj, p) for traj, p in trajectories(7, 6)]
        owner = SIZE - 1
        bad = None
        if RANK == owner:
            ring = replay.shard.store.compressed["pixels"]
            live = replay.shard.live_keys().tolist()
            starts, lengths = replay.shard.locate(live)
            cap = replay.shard.capacity_steps

            def sealed_chunk(i):  # the first sealed chunk trajectory i reads
                for s in range(int(lengths[i])):
                    j = (int(starts[i]) + s) % cap // ring.k
                    if ring.chunks[j] is not None:
                        return j
                return None
            i, j = next((i, sealed_chunk(i)) for i in range(len(live)) if sealed_chunk(i) is not None)
            twin_replays.flip_a_byte(ring, j)
            bad = live[i]
        bad = COMM.bcast(bad, root=owner)
        with pytest.raises(gm.CorruptDataError, match=rf"rank {owner}: column 'pixels': .*compressed chunk .*"
                                                      rf"\(keys \[[^]]*{bad}[^]]*\]\).*CRC-32"):
            replay.get_many([bad])
        assert replay.get_many([]) == []  # the replay goes on
    finally:
        replay.close()


@pytest.mark.parametrize("force_alltoallv", [False, True])
def test_sampling_a_damaged_chunk_fails_on_every_rank(force_alltoallv):
    """The last rank's compressed chunks have a flipped byte each. A sample that reads one -- the owner
    decoding a window it sends, or a rank decoding a window it reads directly -- raised on that rank alone,
    and the others waited until their timeout or went on to a call it never joined. Now every rank raises
    the same CorruptDataError in the same sample, and the replay goes on."""
    _, comp_spec = twin_specs(2)
    replay = gm.Replay(comp_spec, 30, gm.Uniform(), seed=1, memory="private", timeout=20.0,
                       force_alltoallv=force_alltoallv)
    try:
        for traj, p in trajectories(7, 6):
            replay.insert(traj, p)
        owner = SIZE - 1
        if RANK == owner:
            ring = replay.shard.store.compressed["pixels"]
            for j, c in enumerate(ring.chunks):
                if c is not None:
                    twin_replays.flip_a_byte(ring, j)
        failed = None
        for i in range(40):
            try:
                replay.sample(8, 3)
            except gm.CorruptDataError as e:
                failed = (i, str(e))
                break
        every = COMM.allgather(failed)
        assert every[0] is not None and all(f == every[0] for f in every), every
        assert f"rank {owner}: column 'pixels'" in every[0][1] or SIZE == 1, every[0]
        assert "CRC-32" in every[0][1]
        assert replay.stats()["total"]["items"] > 0  # a collective: every rank is still in step
    finally:
        replay.close()

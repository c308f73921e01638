"""File-backed replays (memory="file", path=) and mapped checkpoints (load(mmap=True)) on K ranks.

Run by tests/test_file_memory.py on 1, 2 (``--force-alltoallv``) and 3 ranks; by hand:
``mpiexec -n 3 python -m pytest tests/mpi/test_file_memory.py``.

- Every mode and selector, windows aligned at random, head and tail and whole trajectories: a
  file-backed replay returns bit for bit the batches of a private-memory replay built with the
  same seed and filled alike (keys equal but for the replays' random tags), and its windows are
  the trajectories' steps. Node peers read each other's files directly (``windows_shared``)
  unless forced through MPI.
- A rank whose path is missing makes construction fail on every rank with the same StorageError.
- Checkpoints: a file-backed replay saves; ``load(mmap=True)`` maps each rank's columns.bin (kind
  "mapped", node peers' windows through MPI) and draws the very batches a plain load draws, and
  inserts into it never reach the files; a damaged columns.bin is caught by ``verify=True``
  and by ``checkpoint.verify``, and a truncated one always; loading into file-backed shards
  works; mmap onto another number of ranks warns and reshards; a mapped replay saves over the
  checkpoint it maps; mmap of the version-2 fixture warns and reads it.
- Another process rewriting rank 0's mapped columns.bin in place or truncating it is not held past the
  replay's calls, and the next sample, get_many, save and batches() batch raise the same CheckpointError
  on every rank (get and insert on rank 0), with a lease or (``GEAR_MPI_MMAP_LEASE=0``) without; close
  gives the leases back.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import gear_mpi as gm
from checkpoint_checks import shared_dir  # noqa: F401 (fixture)
from gear_mpi import checkpoint as ck
from gear_mpi.storage import arenas, file_guard
from replay_checks import (COMM, NO_TAG, RANK, SIZE, SPEC, TIMEOUT, check_windows, expect_same_error, fill,
                           keys_of, same_batch, shard_sizes)

SELECTORS = {"Uniform": gm.Uniform, "Prioritized": lambda: gm.Prioritized(0.7, 0.5), "Fifo": gm.Fifo,
             "Lifo": gm.Lifo, "MaxPriority": gm.MaxPriority, "MinPriority": gm.MinPriority}


def build(sel, mode, force, **kw) -> gm.Replay:
    return gm.Replay(SPEC, 150, sel, mode=mode, seed=7, timeout=TIMEOUT, force_alltoallv=force, **kw)


def rank_path(base: str) -> str:
    """A directory of its own per rank (path may differ between ranks), made here."""
    p = os.path.join(base, f"disk{RANK}")
    os.makedirs(p, exist_ok=True)
    return p


def fill_in_turn(replay: gm.Replay, n: int, seed: int) -> dict:
    """:func:`fill`, one rank after another: Fifo and Lifo order ranks' items by insertion time, so
    that two replays filled this way hold the same global order."""
    ref = {}
    for r in range(SIZE):
        part = fill(replay, n if r == RANK else 0, seed)  # every rank gathers; only rank r inserts
        ref.update(part)
    return ref


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("mode", ["decentralized", "centralized", "local"])
def test_file_backed_replay_matches_private_memory(shared_dir, mode, selector, force):
    replays = [build(SELECTORS[selector](), mode, force, memory="private"),
               build(SELECTORS[selector](), mode, force, memory="file", path=rank_path(shared_dir))]
    try:
        assert replays[1].shard.store.arena.kind == "file"
        assert os.listdir(rank_path(shared_dir)) == [], "the files are unlinked once every node peer mapped them"
        refs = [fill_in_turn(r, shard_sizes()[RANK] + 2, seed=3) for r in replays]
        from_peers = 0  # rows owned by another rank: read from its mapped files unless forced through MPI
        for align, window in (("random", 5), ("head", 12), ("tail", 7), ("random", None)):
            ask = 0 if RANK == SIZE - 1 and SIZE > 1 else 3 + RANK
            a, b = (r.sample(ask, window, align) for r in replays)
            same_batch(a, b, f"{mode} {selector} {align}", keys="untagged")
            check_windows(b, refs[1], window or SPEC.max_length, align)
            from_peers += int((gm.keys.decode(keys_of(b))[1] != RANK).sum())
        st = replays[1].stats()
        shared = COMM.allreduce(from_peers) > 0 and not force  # (an ordered selector may draw only own items)
        if SIZE > 1 and mode != "local":
            assert (st["total"]["windows_shared"] > 0) == shared, (st["total"], from_peers)
    finally:
        for r in replays:
            r.close()
    # closed, still referenced: no mapping of this rank's or a node peer's (unlinked) files is left, so their
    # disk space is free at close (the node fence's counters kept the arenas mapped until collected)
    with open("/proc/self/maps") as f:
        left = sorted({line.split(None, 5)[5].strip() for line in f if shared_dir in line})
    assert left == [], left


def test_a_bad_path_fails_on_every_rank(shared_dir):
    path = os.path.join(shared_dir, "missing") if RANK == SIZE - 1 else rank_path(shared_dir)
    expect_same_error(lambda: build(gm.Uniform(), "decentralized", False, memory="file", path=path),
                      gm.StorageError, f"rank {SIZE - 1}: path ")
    COMM.Barrier()
    assert os.listdir(rank_path(shared_dir)) == [], "the ranks that had made their files removed them"


def drive(replay: gm.Replay, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed + RANK)
    out = []
    for i in range(steps):
        b = replay.sample(2 + RANK, 5, ("random", "head", "tail")[i % 3])
        replay.update_priorities(keys_of(b), rng.uniform(0.1, 3.0, len(b)))
        out.append(b)
    return out


@pytest.fixture
def saved(shared_dir, force):
    """A file-backed replay (rings wrapped) saved to ``cp``; its next batches; the directory."""
    replay = build(gm.Prioritized(0.6, 0.4), "decentralized", force, memory="file", path=rank_path(shared_dir))
    for k in range(3):
        fill(replay, 10 + 4 * RANK, seed=k)  # 3 rounds of ~6.5 steps each: the 150-step rings wrap
    drive(replay, 2, seed=1)
    cp = os.path.join(shared_dir, "cp")
    replay.save(cp)
    expect = drive(replay, 4, seed=2)
    replay.close()
    return cp, expect, shared_dir


def test_mmap_reopen_draws_what_a_plain_load_draws(saved, force):
    cp, expect, base = saved
    for kw in ({}, {"mmap": True}, {"mmap": True, "verify": True}, {"memory": "file", "memory_path": rank_path(base)}):
        replay, (old, new) = gm.Replay.load(cp, timeout=TIMEOUT, force_alltoallv=force, **kw)
        assert np.array_equal(old, new)
        assert replay.shard.store.arena.kind == {True: "mapped"}.get(kw.get("mmap"), kw.get("memory", "shm" if
                                                  replay.node.size > 1 else "private"))
        shared = replay.stats()["total"]["windows_shared"]  # restored from the checkpoint
        for i, (a, b) in enumerate(zip(expect, drive(replay, 4, seed=2))):
            same_batch(a, b, f"{kw} batch {i}")
        if kw.get("mmap"):  # node peers cannot see copy-on-write pages: their windows go through MPI
            assert replay.stats()["total"]["windows_shared"] == shared
            replay.insert_many([{"obs": np.ones((12, 3), np.float32), "step": np.zeros(12, np.int64),
                                 "flag": np.ones((12, 2), np.uint8)}] * 12)  # overwrites most of the ring
        replay.close()
    COMM.Barrier()
    ck.verify(cp)  # what the mapped replays wrote never reached the files


def test_damaged_columns_file(saved):
    cp, _, base = saved
    if RANK == 0:
        body = ck.read_manifest(cp)["body"]
        head = ck.shard_files.ring_head(ck.shard_files.read_meta(cp, body, 0))
        where = arenas.HEADER_BYTES + head * SPEC["obs"].step_bytes + 1  # the oldest step of the first column
        with open(os.path.join(cp, ck.rank_dir(0), "columns.bin"), "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0x10]))
    COMM.Barrier()
    replay, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True)  # not verified: it maps
    replay.close()
    for kw in ({"mmap": True, "verify": True}, {}):
        expect_same_error(lambda: gm.Replay.load(cp, timeout=TIMEOUT, **kw), gm.CheckpointError,
                          "rank-00000/columns.bin: sha256 does not match the manifest")
    with pytest.raises(gm.CheckpointError, match="columns.bin: sha256 does not match"):
        ck.verify(cp, ranks=[0])
    COMM.Barrier()
    if RANK == 0:
        os.truncate(os.path.join(cp, ck.rank_dir(0), "columns.bin"), 1000)
    COMM.Barrier()
    expect_same_error(lambda: gm.Replay.load(cp, timeout=TIMEOUT, mmap=True), gm.CheckpointError,
                      "columns.bin: 1000 bytes, the manifest says")


def test_mmap_onto_other_ranks_warns_and_reshards(saved):
    cp, expect, _ = saved
    alone = COMM.Split(RANK, 0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        replay, (old, new) = gm.Replay.load(cp, alone, timeout=TIMEOUT, mmap=True, capacity_steps=150 * SIZE + 1)
    assert any("reshards, which copies" in str(w.message) for w in got), [str(w.message) for w in got]
    assert replay.shard.store.arena.kind == "private" and (new >= 0).all()
    assert replay.stats()["total"]["items"] == len(old)
    replay.close()
    alone.Free()


def test_save_over_the_mapped_checkpoint(saved):
    """A replay loaded with mmap=True saves over the very checkpoint it maps; the result loads the same."""
    cp, _, _ = saved
    replay, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True)
    fill(replay, 3, seed=9)  # copy-on-write pages
    replay.save(cp)  # the old files are renamed and removed while mapped: the mapping keeps them
    expect = drive(replay, 3, seed=4)
    replay.close()
    again, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True, verify=True)
    for i, (a, b) in enumerate(zip(expect, drive(again, 3, seed=4))):
        same_batch(a, b, f"batch {i}")
    again.close()


def test_mmap_of_a_version_2_checkpoint_warns_and_reads():
    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoint_v2")
    alone = COMM.Split(RANK, 0)
    with pytest.warns(UserWarning, match="format version 2, whose column files cannot be mapped"):
        replay, (old, new) = gm.Replay.load(fixture, alone, timeout=TIMEOUT, mmap=True, capacity_steps=48)
    assert replay.shard.store.arena.kind == "private" and (new >= 0).all() and len(replay) == len(old)
    replay.close()
    alone.Free()


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="run with NUMBA_ENABLE_CUDASIM=1")
def test_device_replay_on_file_memory_on_the_simulator(shared_dir):
    """device="cuda" registers the file-backed (and the mapped) arena: on the CUDA simulator it matches
    a CPU replay (on a GPU the registration may be refused; see gear_mpi.storage.file_arenas)."""
    kw = dict(mode="decentralized", seed=11, timeout=TIMEOUT)
    gpu = gm.Replay(SPEC, 60, gm.Prioritized(0.7, 0.5), device="cuda", memory="file", path=rank_path(shared_dir), **kw)
    cpu = gm.Replay(SPEC, 60, gm.Prioritized(0.7, 0.5), **kw)
    for r in (gpu, cpu):
        fill(r, 4 + RANK, seed=5)
    for align in ("random", "tail"):
        a, b = gpu.sample(2 + RANK, 4, align), cpu.sample(2 + RANK, 4, align)
        assert a.device == gpu.device.torch_device
        for name in SPEC.names:
            assert np.array_equal(a[name].cpu().numpy(), b[name].cpu().numpy()), name
        assert np.array_equal(a.keys.cpu().numpy() & NO_TAG, b.keys.numpy() & NO_TAG)
    cp = os.path.join(shared_dir, "cp-dev")
    cpu.save(cp)
    expect = cpu.sample(3, 4)
    cpu.close()
    gpu.close()
    mapped, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True, device="cuda")
    got = mapped.sample(3, 4)
    for name in SPEC.names:
        assert np.array_equal(got[name].cpu().numpy(), expect[name].numpy()), name
    mapped.close()


# in place: steps after the header; a truncation to nothing (every page of the mapping then lies past the end)
WRITERS = {"write": "f = open({f!r}, 'r+b'); f.seek(128); f.write(b'\\xff' * 512); f.close()",
           "truncate": "import os; os.truncate({f!r}, 0)"}


@pytest.mark.parametrize("how,lease", [("write", True), ("truncate", True), ("truncate", False)],
                         ids=["write-lease", "truncate-lease", "truncate-no-lease"])
def test_a_mapped_checkpoint_changed_by_another_process(saved, monkeypatch, how, lease):
    """Another process rewrites rank 0's mapped columns.bin in place, or truncates it (issue 30, item 4): the
    writer is not held past the replay's calls, and then every call that reads the columns raises the same
    CheckpointError on every rank, naming the file (sample, get_many, a batches() iterator's next batch,
    save), as rank 0's local ones do (get, insert); nothing reads changed steps and no rank dies of SIGBUS.
    Without a lease (``GEAR_MPI_MMAP_LEASE=0``) a truncation between calls is caught by the file's size."""
    cp, _, _ = saved
    if lease:
        monkeypatch.delenv(file_guard.LEASE_VAR, raising=False)
    else:
        monkeypatch.setenv(file_guard.LEASE_VAR, "0")
    replay, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True)
    guard = replay.shard.store.arena.guard
    assert guard.mode == ("lease" if lease else "stat") or guard.why_no_lease, guard.why_no_lease
    mine = replay.shard.live_keys()
    before = replay.sample(2 + RANK, 5)
    it = replay.batches(2, 5, prefetch=1) if how == "write" else None
    if it is not None:
        next(it)
    target = os.path.join(cp, ck.rank_dir(0), "columns.bin")
    manifest = ck.read_manifest(cp)["sha256"]
    COMM.Barrier()
    if RANK == 0:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", WRITERS[how].format(f=target)], check=True, timeout=60)
        assert time.monotonic() - t0 < 15, "held no longer than the replay's calls, not the lease-break time"
    COMM.Barrier()
    what = f"rank 0: {target} was " + ("truncated by another process (now 0 bytes" if how == "truncate" else "")
    if it is not None:  # the batches sampled ahead before the write arrive; then the error, on every rank at once
        failed = None
        for i in range(4):
            try:
                next(it)
            except gm.CheckpointError as e:
                failed = (i, str(e))
                break
        assert failed is not None, "the iterator went on reading the changed file"
        got = COMM.allgather(failed)
        assert len(set(got)) == 1 and what in got[0][1] and "another process" in got[0][1], got
        it.close()
    expect_same_error(lambda: replay.sample(2 + RANK, 5), gm.CheckpointError, what)
    expect_same_error(lambda: replay.get_many(keys_of(before)), gm.CheckpointError, what)
    if RANK == 0:
        with pytest.raises(gm.CheckpointError, match="load the checkpoint again"):
            replay.get(int(mine[0]))
        with pytest.raises(gm.CheckpointError, match="another process"):
            replay.insert({"obs": np.ones((2, 3), np.float32), "step": np.zeros(2, np.int64),
                           "flag": np.ones((2, 2), np.uint8)})
    elif len(mine):
        assert len(replay.get(int(mine[0]))["step"]) > 0  # the other ranks' files are untouched
    expect_same_error(lambda: replay.save(cp), gm.CheckpointError, what)
    assert ck.read_manifest(cp)["sha256"] == manifest, "the failed save replaced nothing"
    assert not [n for n in os.listdir(os.path.dirname(cp)) if n.startswith("cp.tmp-")]
    assert replay.stats()["total"]["items"] > 0  # what needs no column still works
    replay.close()
    assert not guard.leased


def test_mapped_replay_releases_its_lease_on_close(saved, monkeypatch):
    """While a replay maps a checkpoint, each rank holds a read lease on its columns.bin; close gives it back,
    and a writer then goes on at once, unnoticed by nobody."""
    cp, _, _ = saved
    monkeypatch.delenv(file_guard.LEASE_VAR, raising=False)
    replay, _ = gm.Replay.load(cp, timeout=TIMEOUT, mmap=True)
    guard = replay.shard.store.arena.guard
    if guard.mode != "lease":
        replay.close()
        pytest.skip(f"no lease here: {guard.why_no_lease}")
    mine = os.path.join(cp, ck.rank_dir(RANK), "columns.bin")
    assert guard.leased and _my_leases(mine) == 1
    replay.close()
    assert not guard.leased and _my_leases(mine) == 0
    with open(mine, "r+b"):  # would wait for the lease-break time if a lease were left
        pass


def _my_leases(filename: str) -> int:
    ino = os.stat(filename).st_ino
    with open("/proc/locks") as f:
        return sum(1 for ln in f if " LEASE " in ln and f" {os.getpid()} " in ln
                   and ln.split()[-3].endswith(f":{ino}"))


def test_a_change_during_a_mapped_load_fails_the_load(saved, monkeypatch):
    """Rank 0's columns.bin truncated by another process after it was mapped, before the load returned:
    the load raises the same CheckpointError on every rank (and closes the replay it built)."""
    cp, _, _ = saved
    target = os.path.join(cp, ck.rank_dir(0), "columns.bin")
    restore = ck.shard_files.restore_rank

    def restore_then_truncate(*args, **kwargs):
        meta = restore(*args, **kwargs)
        if RANK == 0:
            subprocess.run([sys.executable, "-c", WRITERS["truncate"].format(f=target)], check=True, timeout=60)
        return meta
    monkeypatch.setattr(ck.shard_files, "restore_rank", restore_then_truncate)
    expect_same_error(lambda: gm.Replay.load(cp, timeout=TIMEOUT, mmap=True), gm.CheckpointError,
                      f"rank 0: {target} was truncated by another process (now 0 bytes")

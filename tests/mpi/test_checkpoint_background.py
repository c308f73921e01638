"""Background, incremental checkpoints (``Replay.checkpoint_every``) and ``Replay.load_latest`` on K ranks.

Run by tests/test_checkpoint_background.py on 2 ranks (``mpiexec -n 2 python -m pytest
tests/mpi/test_checkpoint_background.py`` by hand).

- a checkpoint taken by ``now()`` while sampling goes on restores exactly: the loaded replay draws the
  very batches the running one drew after the checkpoint;
- inserts while a slow thread writes copy (or, past ``copy_limit``, write) the segments it still needs
  before they overwrite them: the checkpoint is the snapshot's state;
- the second checkpoint writes only the segments inserts touched: the others are hard links to the
  first one's files; each checkpoint loads on its own, also after the other is deleted;
- the table too: only its blocks that changed are written, the others linked;
- ``keep``: only the newest complete checkpoints stay; an interrupted one (no manifest) is passed over;
- the schedule rides on ``sample``: with ``seconds=0`` the sample after the previous one finished starts one;
- a failure on one rank is raised by ``wait()`` on every rank, and the checkpoints before it still load;
- ``load_latest`` onto fewer ranks reshards: every live trajectory of the newest checkpoint arrives;
- bad arguments raise the same error on every rank;
- compressed columns: their chunks as stored, restored exactly.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest

import gear_mpi as gm
from checkpoint_checks import COMM, RANK, SIZE, SPEC, drive, fill, same_batch, shared_dir, sub_comm  # noqa: F401
from gear_mpi import checkpoint as ck
from replay_checks import arrays

SEG = 7 * SPEC.step_bytes  # 7 ring steps a segment: a ring of 60 has 9


def make(**kw) -> gm.Replay:
    return gm.Replay(SPEC, 60, gm.Prioritized(0.7, 0.5), seed=3, timeout=30.0, **kw)


def ids_of(replay: gm.Replay) -> set[int]:
    return {int(replay.get(k)["id"][0]) for k in replay.shard.live_keys().tolist()}


def test_exact_restore_from_a_background_checkpoint(shared_dir):
    replay = make()
    fill(replay, 14 + 5 * RANK, base=1)  # the ring wraps
    drive(replay, 3, seed=5)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    seq = handle.now()
    expect = drive(replay, 4, seed=9)  # sampling goes on while the files are written
    fill(replay, 3, base=500)
    path = handle.wait()
    assert path is not None and path.name == ck.series.dir_name(seq), path
    loaded, key_map = gm.Replay.load_latest(shared_dir)
    assert loaded.loaded_from == path
    assert np.array_equal(key_map[0], key_map[1])
    got = drive(loaded, 4, seed=9)
    for i, (a, b) in enumerate(zip(expect, got)):
        same_batch(a, b, f"batch {i}")
    handle.stop()
    assert replay._checkpoints is None and replay.shard.store.on_write is None
    loaded.close()
    replay.close()


def test_a_wait_interrupted_by_keyboardinterrupt_waits_again(shared_dir):
    """SIGINT on rank 0 while ``handle.wait()`` waits for its thread (which waits for rank 1's files, paced):
    CPython 3.11 then takes the thread for ended, so the next ``wait()`` (or ``now()``, ``close()``) went on
    at once while it still wrote. Now the next one waits for it: the checkpoint is complete when it returns."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    replay = make()
    fill(replay, 14, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG, write_rate=500.0)
    seq = handle.now()
    if RANK == 0:
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                handle.wait()  # rank 1 writes at 500 B/s until its own wait, at 1 s
        finally:
            timer.join()
            signal.signal(signal.SIGINT, old)
    else:
        time.sleep(1.0)
    path = handle.wait()
    assert path is not None and path.name == ck.series.dir_name(seq), path
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gear_mpi-checkpoint")]
    handle.stop()
    replay.close()


@pytest.mark.parametrize("copy_limit", [1 << 30, 0])
def test_inserts_while_the_thread_writes_copy_what_it_still_needs(shared_dir, copy_limit):
    """A slow writer (``write_rate``: seconds for a ring of 60 steps) while inserts overwrite every segment, the
    ring wrapping twice: each insert copies the pending segments it is about to overwrite (or, with
    ``copy_limit=0``, writes their files itself), and the checkpoint restores exactly the snapshot's state."""
    replay = make()
    fill(replay, 14 + 5 * RANK, base=1)
    drive(replay, 2, seed=5)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG, copy_limit=copy_limit,
                                     write_rate=3 * SEG)
    handle.now()
    expect = drive(replay, 3, seed=9)
    fill(replay, 30, base=900)  # about 150 steps into a ring of 60: every pending segment overwritten
    path = handle.wait()
    last = handle.last
    assert last["changed"] > 0 and last["linked"] == 0, last
    if copy_limit:
        assert last["copied_in_loop"] > 0 and last["written_in_loop"] == 0, last
    else:
        assert last["written_in_loop"] > 0 and last["copied_in_loop"] == 0, last
    ck.verify(path)
    loaded, _ = gm.Replay.load(path)
    for i, (a, b) in enumerate(zip(expect, drive(loaded, 3, seed=9))):
        same_batch(a, b, f"batch {i}")
    loaded.close()
    handle.stop()
    replay.close()


def test_a_segment_an_insert_cannot_write_fails_the_checkpoint_not_the_insert(shared_dir, monkeypatch):
    replay = make()
    fill(replay, 8, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG, copy_limit=0,
                                     write_rate=3 * SEG)
    if RANK == SIZE - 1:
        real = ck.files.write_file

        def full(filename, chunks):
            if os.path.basename(filename).startswith("seg-"):
                raise OSError(28, "No space left on device")
            return real(filename, chunks)
        monkeypatch.setattr(ck.files, "write_file", full)
    handle.now()
    fill(replay, 30, base=700)  # every insert goes on
    with pytest.raises(gm.CheckpointError, match="could not write seg-.* past copy_limit: .*No space left"):
        handle.wait()
    monkeypatch.undo()
    assert ck.latest(shared_dir) is None
    assert len(replay.sample(4, 2)) == 4 + 0 * RANK
    handle.now()  # the next one writes everything, and completes
    ck.verify(handle.wait())
    handle.stop()
    replay.close()


def test_second_checkpoint_links_what_did_not_change(shared_dir):
    replay = make()
    fill(replay, 6, base=1)  # 1 + i % 9 steps each: about 21 steps, 3-4 segments, no wrap
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    first = handle.now()
    one = handle.wait()
    assert handle.last["linked"] == 0 and handle.last["changed"] > 0
    ids_first = ids_of(replay)
    replay.insert(ck_traj := {"obs": np.ones((2, 3), np.float32), "id": np.full(2, 7777 + RANK, np.int64),
                              "flag": np.zeros((2, 2), np.uint8)})
    del ck_traj
    handle.now()
    two = handle.wait()
    assert two.name == ck.series.dir_name(first + 1)
    last = handle.last
    assert last["linked"] > 0, last
    assert last["changed"] <= 2 * SEG, last  # the segment(s) the insert wrote, not the whole ring
    mine = two / ck.rank_dir(RANK)
    segs = sorted(p.name for p in mine.glob("seg-*.bin"))
    linked = [n for n in segs if os.stat(mine / n).st_nlink > 1]
    assert linked and len(linked) < len(segs), (segs, linked)
    for n in linked:
        assert os.path.samefile(mine / n, one / ck.rank_dir(RANK) / n)
    ck.verify(one)
    ck.verify(two)
    # each loads on its own: the first one's data is the first one's
    a, _ = gm.Replay.load(one)
    assert ids_of(a) == ids_first
    a.close()
    COMM.Barrier()
    if RANK == 0:
        import shutil
        shutil.rmtree(one)
    COMM.Barrier()
    b, _ = gm.Replay.load_latest(shared_dir)
    assert b.loaded_from == two and ids_of(b) == ids_first | {7777 + RANK}
    b.close()
    handle.stop()
    replay.close()


def test_the_table_is_incremental_too(shared_dir, monkeypatch):
    """The table goes in blocks (4 KiB here): the second checkpoint, after a few inserts and a priority
    update, writes only the blocks they changed (the sections' tails, the updated row's block) and links the
    rest; it loads exactly, also after the first is deleted, and ``verify`` passes."""
    from gear_mpi.checkpoint import table_blocks
    monkeypatch.setattr(table_blocks, "BLOCK", 4096)
    replay = gm.Replay(SPEC, 9000, gm.Prioritized(0.7, 0.5), max_items=6000, seed=4, timeout=30.0)
    n = 3000 + 100 * RANK  # one-step items: 24 kB a section of int64
    replay.insert_packed({"obs": np.zeros((n, 3), np.float32), "id": np.arange(n) + 100_000 * RANK,
                          "flag": np.zeros((n, 2), np.uint8)}, np.ones(n, np.int64), np.ones(n))
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    handle.now()
    one = handle.wait()
    first = dict(handle.last)
    assert first["table_linked"] == 0 and first["table_written"] > 10 * 4096, first
    keys = replay.shard.live_keys()
    replay.update_priorities(keys[5:6], [9.0])  # one row in place: its block, and the index's
    fill(replay, 4, base=50)
    handle.now()
    two = handle.wait()
    last = handle.last
    assert last["table_linked"] > last["table_written"] > 0 and last["table_written"] <= 20 * 4096, last  # tails
    mine = two / ck.rank_dir(RANK)
    blocks = sorted(p.name for p in mine.glob("table-*.bin"))
    assert not (mine / "table.bin").exists() and blocks
    linked = [b for b in blocks if os.stat(mine / b).st_nlink > 1]
    assert linked and "table-start-00000.bin" in linked and "table-priority-00000.bin" not in linked, linked
    assert all(os.path.samefile(mine / b, one / ck.rank_dir(RANK) / b) for b in linked)
    ck.verify(two)
    expect = drive(replay, 3, seed=2)
    COMM.Barrier()
    if RANK == 0:
        import shutil
        shutil.rmtree(one)
    COMM.Barrier()
    loaded, _ = gm.Replay.load_latest(shared_dir)
    assert loaded.loaded_from == two
    for i, (a, b) in enumerate(zip(expect, drive(loaded, 3, seed=2))):
        same_batch(a, b, f"batch {i}")
    loaded.close()
    handle.stop()
    replay.close()


def test_keep_and_interrupted_checkpoints(shared_dir):
    replay = make()
    fill(replay, 5, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    for i in range(4):
        fill(replay, 1, base=100 + i)
        handle.now()
    newest = handle.wait()
    COMM.Barrier()
    names = sorted(n for n in os.listdir(shared_dir) if n.startswith("ckpt-"))
    assert len(names) == 2 and newest.name == names[-1], names
    COMM.Barrier()
    if RANK == 0:  # a checkpoint killed while writing: a newer directory without a manifest
        os.makedirs(os.path.join(shared_dir, ck.series.dir_name(99), ck.rank_dir(0)))
    COMM.Barrier()
    assert ck.latest(shared_dir) == newest
    loaded, _ = gm.Replay.load_latest(shared_dir)
    assert loaded.loaded_from == newest and ids_of(loaded) == ids_of(replay)
    loaded.close()
    handle.stop()
    replay.close()


def test_the_schedule_rides_on_sample(shared_dir):
    replay = make()
    fill(replay, 8, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=0.0, keep=3, segment_bytes=SEG)
    assert ck.latest(shared_dir) is None
    replay.sample(4, 2)  # every rank votes 1 (due, nothing in flight): it starts after this sample
    assert handle.started == 1
    first = handle.wait()
    assert first is not None
    handle.seconds = 3600.0
    replay.sample(4, 2)
    assert handle.started == 1  # not due
    assert handle.stop() == first
    replay.sample(4, 2)  # detached: no vote, no start
    assert handle.started == 1
    replay.close()


def test_a_failure_is_raised_everywhere_and_the_previous_one_stays(shared_dir, monkeypatch):
    replay = make()
    fill(replay, 8, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    handle.now()
    good = handle.wait()
    if RANK == SIZE - 1:
        for writer in ("write_file", "write_file_direct"):
            def broken(filename, chunks, real=getattr(ck.files, writer)):
                if os.path.basename(filename).startswith("table"):
                    raise OSError(28, "No space left on device")
                return real(filename, chunks)
            monkeypatch.setattr(ck.files, writer, broken)
    fill(replay, 2, base=300)
    handle.now()
    with pytest.raises(gm.CheckpointError, match="No space left"):
        handle.wait()
    monkeypatch.undo()
    assert ck.latest(shared_dir) == good
    handle.now()  # the next one writes everything again, and completes
    newest = handle.wait()
    assert newest != good and ck.latest(shared_dir) == newest
    ck.verify(newest)
    handle.stop()
    replay.close()


def test_a_rank_that_cannot_even_say_it_failed_fails_every_rank_within_the_deadline(shared_dir, monkeypatch):
    """A full disk on the last rank: its files fail and so does its ``failed.json``. Rank 0's thread, waiting for
    that rank's files, used to hold ``wait`` and ``now`` on rank 0 until its own deadline while the other ranks
    timed out (CollectiveTimeoutError, the replay unusable); now every rank raises the CheckpointError at once
    and the replay samples on."""
    replay = gm.Replay(SPEC, 60, gm.Prioritized(0.7, 0.5), seed=3, timeout=4.0)
    fill(replay, 8, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    handle.now()
    good = handle.wait()
    if RANK == SIZE - 1:
        for writer in ("write_file", "write_file_direct"):
            def full(filename, *args, **kw):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(ck.files, writer, full)
    for call in (handle.wait, handle.now):  # now() reports the failure of the one before it, and starts one
        fill(replay, 2, base=300)
        handle.now()
        started = time.monotonic()
        with pytest.raises(gm.CheckpointError, match="No space left"):
            call()
        assert time.monotonic() - started < 3.0, call  # not rank 0's deadline (4 s and more)
        replay.sample(3, 2)  # the replay still communicates
    monkeypatch.undo()
    with pytest.raises(gm.CheckpointError, match="No space left"):  # the one the last now() started
        handle.wait()
    assert ck.latest(shared_dir) == good
    handle.now()
    newest = handle.wait()
    assert newest != good and ck.latest(shared_dir) == newest
    handle.stop()
    replay.close()


def test_load_latest_onto_fewer_ranks_and_when_there_is_none(shared_dir):
    empty = os.path.join(shared_dir, "none")
    assert gm.Replay.load_latest(empty) == (None, None)
    replay = make()
    fill(replay, 9 + RANK, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=1, segment_bytes=SEG)
    handle.now()
    handle.wait()
    every = set().union(*COMM.allgather(ids_of(replay)))
    handle.stop()
    replay.close()
    sub = sub_comm(1)
    if sub is not None:
        # room for what every rank held (at most 60 steps and 9 + rank trajectories each), whatever their number
        loaded, key_map = gm.Replay.load_latest(shared_dir, sub, capacity_steps=60 * SIZE,
                                                max_items=9 * SIZE + SIZE * (SIZE - 1) // 2)
        assert len(key_map[0]) == len(every)
        assert ids_of(loaded) == every
        loaded.sample(3, 2)
        loaded.close()
    COMM.Barrier()


def test_bad_arguments_fail_on_every_rank(shared_dir):
    replay = make()
    with pytest.raises(ValueError, match=r"keep must be an integer in \[1, "):
        replay.checkpoint_every(shared_dir, keep=0 if RANK == 0 else 2)
    # None, or an int too large for a float, raised float()'s error on that rank alone, before the agreement
    for kw in ({"keep": None}, {"segment_bytes": None}, {"keep": 10 ** 400}):
        bad = {k: (v if RANK == SIZE - 1 else 2) for k, v in kw.items()}
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"checkpoints: rank {SIZE - 1}: {name} must be an integer in \[1, "):
            replay.checkpoint_every(shared_dir, **bad)
    with pytest.raises(ValueError, match=r"cpu_share must be a number > 0 and <= 1, or None; got 2"):
        replay.checkpoint_every(shared_dir, cpu_share=2.0 if RANK == 0 else 0.1)
    with pytest.raises(ValueError, match="write_rate must be a number > 0"):
        replay.checkpoint_every(shared_dir, write_rate=-5)
    with pytest.raises(ValueError, match="priority must be 'low', 'nice' or 'normal'"):
        replay.checkpoint_every(shared_dir, priority="high")
    assert replay._checkpoints is None and replay.shard.store.on_write is None
    if SIZE > 1:  # (one rank cannot differ from itself)
        with pytest.raises(ValueError, match="the same on every rank"):
            replay.checkpoint_every(shared_dir, seconds=10.0 + RANK)
    replay._checkpoints.detach() if replay._checkpoints is not None else None
    with pytest.raises(TypeError, match="directory must be"):
        replay.checkpoint_every(3)
    if SIZE > 1:  # every rank but 0 names another directory than rank 0's
        with pytest.raises(ValueError, match=rf"the same directory .* rank\(s\) {re.escape(str(list(range(1, SIZE))))} "
                                             r"gave another"):
            replay.checkpoint_every(os.path.join(shared_dir, f"rank{RANK}"), seconds=None)  # was: a timeout, broken
    assert replay._checkpoints is None and replay.shard.store.on_write is None
    handle = replay.checkpoint_every(shared_dir, seconds=None)
    with pytest.raises(ValueError, match="already has background checkpoints"):
        replay.checkpoint_every(shared_dir)
    handle.stop()
    replay.close()


def test_compressed_columns_are_checkpointed_in_the_background(shared_dir):
    """A replay with a compressed column (blosc2 chunks, as stored, in ``compressed.bin``; the raw column in
    segments): a checkpoint taken while inserts go on (the ring wraps: sealed chunks replaced, the open one
    written) restores exactly the snapshot's state; so does a later, incremental one."""
    pytest.importorskip("blosc2")
    spec = gm.TrajectorySpec({"pixels": ((8, 8), "uint8", gm.Compressed()), "reward": ((), "float32")}, 4)
    replay = gm.Replay(spec, 64, gm.Uniform(), comm=COMM, seed=1, timeout=10.0)
    rng = np.random.default_rng(RANK)

    def put(n: int) -> None:
        for _ in range(n):
            steps = int(rng.integers(1, 5))
            replay.insert({"pixels": rng.integers(0, 4, (steps, 8, 8)).astype(np.uint8),
                           "reward": rng.random(steps).astype(np.float32)})

    def batches(r: gm.Replay) -> list:
        return [r.sample(5, window=2) for _ in range(3)]

    def same(a: list, b: list) -> None:
        for x, y in zip(map(arrays, a), map(arrays, b)):
            for name in ("keys", "lengths", "mask", "pixels", "reward"):
                assert np.array_equal(x[name], y[name]), name

    try:
        put(12)
        handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=8 * 4, write_rate=200.0)
        handle.now()
        expect = batches(replay)
        put(25)  # about 60 steps into a ring of 64 while the thread writes
        first = handle.wait()
        ck.verify(first)
        mine = first / ck.rank_dir(RANK)
        assert (mine / "compressed.bin").is_file() and list(mine.glob("seg-*.bin"))
        loaded, _ = gm.Replay.load(first)
        same(expect, batches(loaded))
        loaded.close()
        handle.now()  # everything changed since the first: all written again
        handle.wait()
        put(2)
        handle.now()  # two inserts later: their segments written, the others linked
        expect = batches(replay)
        third = handle.wait()
        assert handle.last["linked"] > 0 and handle.last["changed"] < 64 * 4, handle.last
        ck.verify(third)
        loaded, _ = gm.Replay.load_latest(shared_dir)
        assert loaded.loaded_from == third
        same(expect, batches(loaded))
        loaded.close()
        handle.stop()

        def items(r: gm.Replay) -> list:
            out = []
            for k in r.shard.live_keys().tolist():
                t = r.get(k)
                out.append((np.asarray(t["reward"]).tobytes(), np.asarray(t["pixels"]).tobytes()))
            return out
        every = sorted(sum(COMM.allgather(items(replay)), []))  # nothing inserted since the third
        sub = sub_comm(1)
        if sub is not None:  # resharded onto one rank: the chunks decompressed, the segments read
            # room for every rank's items (a 64-step ring and its items each): the test runs on any number of ranks
            one, key_map = gm.Replay.load_latest(shared_dir, sub, capacity_steps=64 * SIZE, max_items=64 * SIZE)
            assert sorted(items(one)) == every
            one.close()
        COMM.Barrier()
    finally:
        replay.close()

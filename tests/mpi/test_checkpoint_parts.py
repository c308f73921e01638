"""Ring segments stored in parts (format version 6): a partly filled segment is not written again whole.

Run by tests/test_checkpoint_parts.py on 2 ranks (``mpiexec -n 2 python -m mpi4py -m pytest
tests/mpi/test_checkpoint_parts.py`` by hand; on one rank as a plain process too).

- the segment at the write position is stored up to the write position only; the next checkpoint links
  that file and writes one more part holding only the steps inserted since (``seg-NNNNN+OFFSET.bin``);
- every checkpoint of a series of small inserts loads exactly (the ids live at each) and passes
  ``verify``, also after the older ones are deleted; a segment never has more than ``MAX_PARTS`` parts;
- a checkpoint with parts reshards (``load_latest`` onto one rank reads the parts through ``ring_reader``);
- :class:`~gear_mpi.checkpoint.incremental.Changes` keeps the lowest ring step written per segment, also
  when an insert wraps into the segment it started in.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import gear_mpi as gm
from checkpoint_checks import COMM, RANK, SIZE, SPEC, fill, shared_dir, sub_comm, traj  # noqa: F401
from gear_mpi import checkpoint as ck
from gear_mpi.checkpoint import incremental, segment_file
from gear_mpi.kernels import ring

K = 20  # ring steps per segment: a ring of 200 has 10
SEG = K * SPEC.step_bytes


def make() -> gm.Replay:
    return gm.Replay(SPEC, 200, gm.Uniform(), seed=3, timeout=30.0)


def ids_of(replay: gm.Replay) -> set[int]:
    return {int(replay.get(k)["id"][0]) for k in replay.shard.live_keys().tolist()}


def meta_of(path) -> dict:
    with open(path / ck.rank_dir(RANK) / "shard.json") as f:
        return json.load(f)


def test_a_partly_filled_segment_gets_a_new_part_not_a_rewrite(shared_dir):
    replay = make()
    # ids 1 - RANK % 9 + 100_000 * RANK + (0..3): lengths 2, 3, 4, 5 on every rank (100_000 = 1 mod 9, and an id's
    # length is 1 + id % 9), 14 steps: the write position inside segment 0
    fill(replay, 4, base=1 - RANK % 9)
    assert 0 < int(replay.shard.store.state[ring.STEPS_USED]) < K
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=3, segment_bytes=SEG)
    handle.now()
    one = handle.wait()
    first_written = handle.last["changed"]
    ids_one = ids_of(replay)
    fill(replay, 1, base=700)  # 1..9 steps more: into the partly filled segment
    handle.now()
    two = handle.wait()
    last = handle.last
    mine = two / ck.rank_dir(RANK)
    meta2 = meta_of(two)
    parts = meta2.get("segment_parts", {})
    assert parts, meta2  # the segment at the old write position is in parts
    s, ranges = max(parts.items(), key=lambda kv: len(kv[1]))
    assert len(ranges) >= 2, parts
    lo, hi = ranges[0]
    first = mine / segment_file.part_name(int(s), lo, K)
    assert os.stat(first).st_nlink > 1 and os.path.samefile(first, one / ck.rank_dir(RANK) / first.name)
    new = mine / segment_file.part_name(int(s), ranges[-1][0], K)
    assert new.name.startswith(f"seg-{int(s):05d}+") and os.stat(new).st_nlink == 1
    # written: the steps of the insert (within at most two segments), not two whole segments
    inserted = 1 + (700 + 100_000 * RANK) % SPEC.max_length
    assert last["changed"] <= (inserted + K) * SPEC.step_bytes and last["changed"] < first_written, last
    for path in (one, two):
        ck.verify(path)
    a, _ = gm.Replay.load(one)
    assert ids_of(a) == ids_one
    a.close()
    b, _ = gm.Replay.load(two)
    assert ids_of(b) == ids_one | {700 + 100_000 * RANK}
    for k in b.shard.live_keys().tolist():  # every step as inserted
        t, want = b.get(k), traj(int(b.get(k)["id"][0]))
        for name in SPEC.names:
            assert np.array_equal(np.asarray(t[name]), want[name]), name
    b.close()
    handle.stop()
    replay.close()


def test_a_series_of_small_inserts_loads_exactly_at_every_checkpoint(shared_dir):
    replay = make()
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=30, segment_bytes=SEG)
    expect = []
    for i in range(14):  # one or two trajectories between checkpoints: the ring wraps at the end
        fill(replay, 1 + i % 2, base=10 * i + 1)
        handle.now()
        expect.append((handle.wait(), ids_of(replay)))
    most = 0
    for path, ids in expect:
        meta = meta_of(path)
        for ranges in meta.get("segment_parts", {}).values():
            most = max(most, len(ranges))
        ck.verify(path)
        r, _ = gm.Replay.load(path)
        assert ids_of(r) == ids, path
        r.close()
    assert 2 <= most <= incremental.MAX_PARTS, most
    # the newest loads on its own once the older ones are gone
    COMM.Barrier()
    if RANK == 0:
        import shutil
        for path, _ in expect[:-1]:
            shutil.rmtree(path)
    COMM.Barrier()
    r, _ = gm.Replay.load_latest(shared_dir)
    assert ids_of(r) == expect[-1][1]
    got = {int(r.get(k)["id"][0]): r.get(k) for k in r.shard.live_keys().tolist()}
    have = {int(replay.get(k)["id"][0]): replay.get(k) for k in replay.shard.live_keys().tolist()}
    for ident, t in got.items():
        for name in SPEC.names:
            assert np.array_equal(np.asarray(t[name]), np.asarray(have[ident][name])), (ident, name)
    r.close()
    handle.stop()
    replay.close()


def test_a_checkpoint_in_parts_reshards(shared_dir):
    replay = make()
    fill(replay, 4, base=1)
    handle = replay.checkpoint_every(shared_dir, seconds=None, keep=2, segment_bytes=SEG)
    handle.now()
    handle.wait()
    fill(replay, 2, base=300)
    handle.now()
    two = handle.wait()
    assert meta_of(two).get("segment_parts"), meta_of(two)
    live = COMM.allgather(ids_of(replay))
    handle.stop()
    replay.close()
    one = sub_comm(1)
    if one is not None:
        r, _ = gm.Replay.load_latest(shared_dir, one, capacity_steps=200 * SIZE + 50)
        assert ids_of(r) == set().union(*live)
        for k in r.shard.live_keys().tolist():
            t = r.get(k)
            want = traj(int(t["id"][0]))
            for name in SPEC.names:
                assert np.array_equal(np.asarray(t[name]), want[name]), name
        r.close()
        one.Free()
    COMM.Barrier()


def test_changes_keep_the_lowest_step_written_per_segment():
    c = incremental.Changes(10, 100)
    c(23, 4)      # segment 2 from 23
    c(27, 2)      # the same segment, later
    c(29, 12)     # 29..40: segments 2, 3, 4
    assert c.take() == {2: 23, 3: 30, 4: 40}
    c(95, 10)     # wraps: 95..99 then 0..4
    assert c.take() == {9: 95, 0: 0}
    one = incremental.Changes(100, 60)  # one segment larger than the ring
    one(50, 5)
    one(55, 8)    # wraps into the segment it started in: its lowest step is 0
    assert one.take() == {0: 0}
    one(10, 2)
    one(5, 1)     # a ring of one segment, written lower again (it wrapped between the two)
    assert one.take() == {0: 5}
    whole = incremental.Changes(10, 30)
    whole(12, 40)  # more than the ring: every segment from its start
    assert whole.take() == {0: 0, 1: 10, 2: 20}


def test_stored_end_and_parts_of():
    k, cap = 10, 100
    assert segment_file.stored_end(2, 0, 25, cap, k) == 25   # partly filled: up to the write position
    assert segment_file.stored_end(1, 0, 25, cap, k) == 20   # full
    assert segment_file.stored_end(2, 0, 100, cap, k) == 30  # a full ring: every step in use
    assert segment_file.stored_end(2, 27, 98, cap, k) == 30  # wrote to 25, oldest at 27: [27, 30) in use
    meta = {"segment_parts": {"2": [[20, 23], [23, 30]]}}
    assert segment_file.parts_of(meta, 2, k, cap) == [(20, 23), (23, 30)]
    assert segment_file.parts_of(meta, 3, k, cap) == [(30, 40)]
    assert segment_file.part_name(2, 20, k) == "seg-00002.bin"
    assert segment_file.part_name(2, 23, k) == "seg-00002+3.bin"
    for bad in ([[21, 30]], [[20, 25], [26, 30]], [[20, 31]], []):
        with pytest.raises(gm.CheckpointError, match="segment 2"):
            segment_file.parts_of({"segment_parts": {"2": bad}}, 2, k, cap)

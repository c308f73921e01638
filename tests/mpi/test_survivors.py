"""The data half of a live recovery (gear_mpi.checkpoint.survivors.rebuild), on 3 ranks, without ULFM.

Run by tests/test_faults.py on 3 ranks under the default MPI (``mpiexec -n 3 python -m pytest
tests/mpi/test_survivors.py`` by hand). Rank 2 plays the dead rank: it takes no part in the rebuild, which
runs on a communicator of ranks 0 and 1 (what ``Replay.recover`` gets from ULFM's shrink; the shrink itself
and the kill are tested under Open MPI in tests/test_faults.py). Afterwards every rank closes the old replay,
whose communicator was never broken.

- the survivors keep every trajectory of their own shards (inserted before and after the checkpoint) bit
  for bit, with its priority, insertion stamp and times sampled, and get the dead rank's trajectories of
  the checkpoint, dealt between them; what the dead rank inserted after it is missing; ``key_map`` maps
  every old key; each new shard keeps insertion-stamp order;
- survivors too small for all of it: CheckpointError on both, the same message; ``allow_drop=True`` drops
  exactly the oldest of the dead rank's trajectories that do not fit;
- ``checkpoint=None``: the survivors' own trajectories only; another replay's checkpoint: CheckpointError;
- an unknown option: TypeError.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import gear_mpi as gm
from checkpoint_checks import COMM, RANK, SIZE, SPEC, rows, shared_dir, slot_of, traj  # noqa: F401
from gear_mpi.checkpoint import survivors as rebuilding

pytestmark = pytest.mark.skipif(SIZE != 3, reason="3 ranks: rank 2 plays the dead one")
DEAD = 2


def prio(ident: int) -> float:
    return 0.25 + (ident % 11)


def ids(batch: int, rank: int) -> list[int]:
    return [1_000_000 * batch + 1000 * rank + i for i in range(5 + 3 * rank)]


def insert(replay: gm.Replay, batch: int) -> None:
    mine = ids(batch, replay.rank)
    replay.insert_many([traj(i) for i in mine], [prio(i) for i in mine])


def survivors_comm():
    from mpi4py import MPI
    sub = COMM.Split(0 if RANK != DEAD else MPI.UNDEFINED, RANK)
    return None if sub == MPI.COMM_NULL else sub


def held(replay: gm.Replay) -> list[tuple[int, int]]:
    """(id, key) of this rank's live trajectories, oldest first, each checked bit for bit."""
    out = []
    for key in replay.shard.live_keys().tolist():
        got = replay.get(key)
        ident = int(got["id"][0])
        want = traj(ident)
        for c in SPEC.names:
            assert got[c].tobytes() == want[c].tobytes(), (ident, c)
        assert replay.shard.priorities([key])[0] == prio(ident), ident
        out.append((ident, key))
    return out


@pytest.fixture
def scene(shared_dir):
    """A replay on 3 ranks: batch 1, checkpoint, batch 2, a few samples (uses counted); the survivors'
    communicator (None on the dead rank). Closes the old replay on every rank afterwards."""
    replay = gm.Replay(SPEC, 400, gm.Prioritized(1.0, 0.4), seed=3, timeout=30.0, max_times_sampled=1000)
    insert(replay, 1)
    for _ in range(3):
        replay.sample(6, 2)
    path = os.path.join(shared_dir, "ck")
    replay.save(path)
    insert(replay, 2)
    for _ in range(2):
        replay.sample(6, 2)
    sub = survivors_comm()
    yield replay, sub, path, shared_dir
    COMM.Barrier()
    replay.close()


def test_survivors_keep_their_shards_and_get_the_dead_ranks_checkpoint(scene):
    replay, sub, path, _ = scene
    if sub is None:
        return
    before = held(replay)
    old_rows = rows(replay.shard)
    history = {i: (int(old_rows["stamp"][slot_of(k)]), int(old_rows["times_sampled"][slot_of(k)])) for i, k in before}
    new, key_map, counts = rebuilding.rebuild(replay, sub, [0, 1], path, rebuilding.options(replay, 2, {}), gm.Replay)
    try:
        assert new.ranks == 2 and new.rank == RANK and not replay.closed
        now = held(new)
        everything = sorted(i for part in sub.allgather([i for i, _ in now]) for i in part)
        want = sorted([i for r in (0, 1) for b in (1, 2) for i in ids(b, r)] + ids(1, DEAD))
        assert everything == want  # the dead rank's batch 2 (after the checkpoint) is the only loss
        assert counts["kept"] == sum(len(ids(b, r)) for r in (0, 1) for b in (1, 2))
        assert counts["restored"] == len(ids(1, DEAD)) and counts["dropped"] == 0
        new_rows = rows(new.shard)
        stamps = []
        for ident, key in now:  # the survivor's own: stamp and uses as they were
            stamps.append(int(new_rows["stamp"][slot_of(key)]))
            if ident in history:
                assert (stamps[-1], int(new_rows["times_sampled"][slot_of(key)])) == history[ident], ident
        assert stamps == sorted(stamps)  # insertion-stamp order, the restored ones merged in
        old_keys, new_keys = key_map
        assert len(old_keys) == len(want) and (new_keys >= 0).all() and (np.diff(old_keys) > 0).all()
        mapped = gm.checkpoint.remap(key_map, [k for _, k in before])
        got = new.get_many(mapped)
        assert [int(t["id"][0]) for t in got] == [i for i, _ in before]
        batch = new.sample(8, 2)
        assert len(batch) == 8
    finally:
        new.close()


def test_survivors_too_small_fail_alike_or_drop_the_oldest_restored(scene):
    replay, sub, path, _ = scene
    if sub is None:
        return
    own_steps = replay.shard.store.live_steps
    steps = np.array(sub.allgather(int(own_steps)))
    cap = int(steps.max()) + 4  # room for almost none of the dead rank's trajectories
    opts = rebuilding.options(replay, 2, {"capacity_steps": cap})
    with pytest.raises(gm.CheckpointError) as e:
        rebuilding.rebuild(replay, sub, [0, 1], path, opts, gm.Replay)
    text = str(e.value)
    assert "cannot hold" in text and "allow_drop=True" in text
    assert sub.allgather(text) == [text, text]
    assert not replay.closed and len(held(replay)) == len(ids(1, RANK)) + len(ids(2, RANK))  # untouched
    opts = rebuilding.options(replay, 2, {"capacity_steps": cap, "allow_drop": True})
    new, key_map, counts = rebuilding.rebuild(replay, sub, [0, 1], path, opts, gm.Replay)
    try:
        restored = sorted(i for part in sub.allgather([i for i, _ in held(new) if i // 1000 % 1000 == DEAD])
                          for i in part)
        assert counts["dropped"] > 0 and counts["restored"] == len(restored)
        assert counts["dropped"] + counts["restored"] == len(ids(1, DEAD))
        assert (key_map[1] == -1).sum() == counts["dropped"]
        mine_dead = [i for i, _ in held(new) if i // 1000 % 1000 == DEAD]
        assert len(held(new)) - len(mine_dead) == len(ids(1, RANK)) + len(ids(2, RANK))  # every own one kept
        assert new.shard.store.live_steps <= cap
        dropped = set(ids(1, DEAD)) - set(restored)
        old_keys, new_keys = key_map
        assert len(dropped) == counts["dropped"] and len(old_keys) == counts["kept"] + len(ids(1, DEAD))
    finally:
        new.close()


def test_no_checkpoint_or_another_replays(scene):
    replay, sub, path, base = scene
    if sub is None:
        return
    with pytest.raises(TypeError, match="unexpected keyword"):
        rebuilding.options(replay, 2, {"mmap": True})
    other = gm.Replay(SPEC, 100, gm.Uniform(), comm=sub, timeout=30.0)
    other.insert(traj(5), 1.0)
    foreign = os.path.join(base, "foreign")
    other.save(foreign)
    other.close()
    with pytest.raises(gm.CheckpointError, match="was not written by this replay"):
        rebuilding.rebuild(replay, sub, [0, 1], foreign, rebuilding.options(replay, 2, {}), gm.Replay)
    new, key_map, counts = rebuilding.rebuild(replay, sub, [0, 1], None, rebuilding.options(replay, 2, {}), gm.Replay)
    try:
        assert sorted(i for i, _ in held(new)) == sorted(ids(1, RANK) + ids(2, RANK))
        assert counts["restored"] == 0 and len(key_map[0]) == counts["kept"]
    finally:
        new.close()

"""Dataset ingest on K ranks: every episode exactly once, errors on every rank, nothing half-built.

Run by tests/test_datasets.py on 1, 2 and 3 ranks over the files of
tests/mpi/dataset_files.py (their directory in $GEAR_MPI_TEST_DATASETS); by hand:
``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_dataset_ingest.py`` (rank 0 then writes the files into
a temporary directory first).

- from_d4rl and from_npz_dir of 49 uneven episodes (the last open): the ranks' episodes
  are disjoint contiguous runs in dataset order, balanced by steps (each share within one
  episode of the mean); fetching every key back (get_many) gives every episode exactly
  once, equal to the file's steps; a Fifo sample of each rank's shard returns its
  episodes oldest first; the open episode is flagged on the rank holding it.
- A missing file on one rank only, a missing dataset, mismatched lengths, a truncated
  file, a non-numeric dataset, a capacity too small: the same ValueError on every rank.
- A file that fails only when read (after the replay was built): the same ValueError on
  every rank, the replay closed (its shared memory gone), the communicator still usable.
- Replay.insert_packed: local, validated like insert_many (nothing stored on a bad batch).
- headroom: free steps per shard beyond the largest share (default max_length), so that an
  insert after the load evicts nothing; a bad headroom fails on every rank.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi.storage import SharedArena
from dataset_files import episodes, root_from_env, step_table
from replay_checks import RANK, SIZE, expect_same_error

COMM = MPI.COMM_WORLD
LENGTHS, OPEN_LAST = episodes()
TABLE = step_table(LENGTHS, OPEN_LAST)
STARTS = np.cumsum(LENGTHS) - LENGTHS


def check_every_episode_once(replay: gm.Replay, names: dict[str, str]) -> None:
    info = replay.dataset_info
    assert info["episodes"] == len(LENGTHS) and info["steps"] == len(TABLE["rewards"])
    mine = info["episode_keys"]
    first = info["first_episode"]
    assert len(mine) == len(replay)
    runs = COMM.allgather((first, len(mine), int(LENGTHS[first:first + len(mine)].sum())))
    # contiguous runs in rank order covering every episode, balanced by steps
    assert [r[0] for r in runs] == list(np.cumsum([0] + [r[1] for r in runs])[:-1])
    assert sum(r[1] for r in runs) == len(LENGTHS)
    mean = LENGTHS.sum() / SIZE
    assert all(abs(r[2] - mean) <= LENGTHS.max() for r in runs), runs
    every = np.concatenate(COMM.allgather(mine))
    got = replay.get_many(every if RANK == 0 else [])
    if RANK == 0:
        steps = np.concatenate([t[names["infos/step"]] for t in got])
        np.testing.assert_array_equal(steps, np.arange(len(TABLE["rewards"])))  # each step once, in order
        for e, t in enumerate(got):
            for col, name in names.items():
                np.testing.assert_array_equal(t[name], TABLE[col][STARTS[e]:STARTS[e] + LENGTHS[e]], err_msg=name)
    # Fifo over this rank's shard: its episodes oldest first
    if len(mine):
        batch = replay.sample(len(mine), 1, "head", mode="local")
        np.testing.assert_array_equal(batch.meta_numpy()[0], mine)
    else:
        replay.sample(0, 1, "head", mode="local")


def test_d4rl_every_episode_exactly_once():
    root = root_from_env()
    replay = gm.datasets.from_d4rl(root / "good.hdf5", COMM, sampler=gm.Fifo(), chunk_bytes=4096, seed=1)
    try:
        assert replay.spec.names == ("observations", "actions", "rewards", "terminals", "timeouts",
                                     "next_observations", "infos/step")
        assert replay.spec.max_length == LENGTHS.max()
        check_every_episode_once(replay, {k: k for k in TABLE})
        info = replay.dataset_info
        holders = COMM.allgather(info["open_episode_key"])
        assert info["open_last_episode"] and sum(k is not None for k in holders) == 1
        last = [k for k in holders if k is not None][0]
        assert last == int(np.concatenate(COMM.allgather(info["episode_keys"]))[-1])
    finally:
        replay.close()


def test_npz_dir_every_episode_exactly_once():
    root = root_from_env()
    replay = gm.datasets.from_npz_dir(root / "good_npz", COMM, sampler=gm.Fifo(), chunk_bytes=2048, max_length=64)
    try:
        assert replay.spec.max_length == 64 and not replay.dataset_info["open_last_episode"]
        check_every_episode_once(replay, {k: k.replace("/", "_") for k in TABLE})
    finally:
        replay.close()


def test_datasets_load_into_file_backed_shards():
    """``path=`` after the dataset's path is the replay's (issue 30, item 8): shards in files under it."""
    root = root_from_env()
    shards = root / f"file_shards_{SIZE}"
    if RANK == 0:
        shards.mkdir(exist_ok=True)
    COMM.Barrier()
    for load, source, names in ((gm.datasets.from_d4rl, root / "good.hdf5", {k: k for k in TABLE}),
                                (gm.datasets.from_npz_dir, root / "good_npz", {k: k.replace("/", "_") for k in TABLE})):
        replay = load(source, COMM, sampler=gm.Fifo(), chunk_bytes=4096, max_length=64, memory="file", path=shards)
        try:
            assert replay.shard.shm_name is not None and replay.shard.shm_name.startswith(str(shards / f"rank-{RANK:05d}"))
            check_every_episode_once(replay, names)
        finally:
            replay.close()


@pytest.mark.parametrize("name,text", [
    ("missing.hdf5", "missing dataset(s) ['timeouts']"),
    ("mismatched.hdf5", "dataset 'rewards' has shape (1045,), but 'observations' has 1050 steps"),
    ("truncated.hdf5", "cannot be opened as HDF5 (truncated or damaged?)"),
    ("text.hdf5", "dataset 'infos/label' has non-numeric dtype"),
    ("nowhere.hdf5", "no such file"),
])
def test_bad_d4rl_file_fails_on_every_rank(name, text):
    root = root_from_env()
    assert LENGTHS.sum() == 1050
    expect_same_error(lambda: gm.datasets.from_d4rl(root / name, COMM), ValueError, text)


def test_bad_npz_dir_fails_on_every_rank():
    root = root_from_env()
    expect_same_error(lambda: gm.datasets.from_npz_dir(root / "odd_npz", COMM), ValueError, "columns ['observations']")
    expect_same_error(lambda: gm.datasets.from_npz_dir(root / "ragged_npz", COMM), ValueError, "mismatched lengths")
    expect_same_error(lambda: gm.datasets.from_npz_dir(root / "empty_npz", COMM), ValueError, "no .npz files")


def test_one_rank_with_a_bad_path_fails_everywhere():
    root = root_from_env()
    bad = SIZE - 1
    path = root / ("nowhere.hdf5" if RANK == bad else "good.hdf5")
    expect_same_error(lambda: gm.datasets.from_d4rl(path, COMM), ValueError, f"from_d4rl: rank {bad}: ")


def test_too_small_a_capacity_fails_everywhere():
    root = root_from_env()
    expect_same_error(lambda: gm.datasets.from_d4rl(root / "good.hdf5", COMM, capacity_steps=40), ValueError,
                      "more than capacity_steps=40")
    expect_same_error(lambda: gm.datasets.from_d4rl(root / "good.hdf5", COMM, max_length=30), ValueError,
                      "more than max_length=30")


def test_headroom_lets_inserts_after_the_load_evict_nothing():
    """Issue 30 item 6: by default each shard keeps max_length free steps beyond the largest share, so the
    first insert after the load evicts nothing; headroom=N keeps N; headroom=0 is the old exact fit."""
    root = root_from_env()
    for headroom, free in ((None, int(LENGTHS.max())), (100, 100), (0, 0)):
        replay = gm.datasets.from_d4rl(root / "good.hdf5", COMM, headroom=headroom, seed=1)
        try:
            spec = replay.spec
            shares = COMM.allgather(int(LENGTHS[replay.dataset_info["first_episode"]:][:len(replay)].sum()))
            assert replay.shard.capacity_steps == max(shares) + free, (headroom, replay.shard.capacity_steps, shares)
            loaded = replay.dataset_info["episode_keys"]
            if RANK == int(np.argmax(shares)):  # the fullest shard: max_length more steps
                episode = {c.name: np.zeros((spec.max_length,) + c.shape, c.dtype) for c in spec.columns}
                replay.insert(episode)
                alive = replay.shard.live_keys()
                evicted = len(np.setdiff1d(loaded, alive))
                assert (evicted == 0) == (free >= spec.max_length), (headroom, evicted)
        finally:
            replay.close()
    expect_same_error(lambda: gm.datasets.from_d4rl(root / "good.hdf5", COMM, headroom=-1), ValueError,
                      "headroom must be an integer in [0, ")
    expect_same_error(lambda: gm.datasets.from_npz_dir(root / "good_npz", COMM, headroom=5, capacity_steps=900),
                      ValueError, "give capacity_steps=900 or headroom=5, not both")


def test_failed_read_closes_the_replay_on_every_rank(monkeypatch):
    # the segments this rank creates are watched (not the machine's /dev/shm: another test's job may be making
    # and removing its own at the same time)
    created = []
    create = SharedArena.__init__

    def recording(self, *args, **kwargs):
        try:
            create(self, *args, **kwargs)
        finally:
            if not kwargs.get("_attach") and hasattr(self, "path"):
                created.append(self.path)
    monkeypatch.setattr(SharedArena, "__init__", recording)
    root = root_from_env()
    expect_same_error(lambda: gm.datasets.from_npz_dir(root / "short_npz", COMM, chunk_bytes=1024), ValueError,
                      "ep_0048.npz: cannot be read")
    COMM.Barrier()
    gc.collect()  # the caught error's frames held views of the segments; their mappings go with them
    assert created or SIZE == 1  # shared memory was in use: a replay of several ranks on one node
    with open("/proc/self/maps") as f:
        mapped = f.read()
    left = [(p, os.path.exists(p), p in mapped) for p in created if os.path.exists(p) or p in mapped]
    assert left == [], left  # nothing of the replay left behind: unlinked and unmapped
    replay = gm.datasets.from_npz_dir(root / "good_npz", COMM)  # the communicator still works
    assert COMM.allreduce(len(replay)) == len(LENGTHS)
    replay.close()


def test_replay_insert_packed_is_local_and_validated():
    spec = gm.TrajectorySpec({"x": ((2,), np.float32), "i": ((), np.int64)}, max_length=8)
    replay = gm.Replay(spec, 200, gm.Fifo(), comm=COMM, seed=2)
    try:
        n = 3 + RANK  # uneven on purpose: insert_packed does not communicate
        lengths = np.arange(1, n + 1)
        i = np.arange(lengths.sum()) + 1000 * RANK
        keys = replay.insert_packed({"x": np.stack([i, i], 1), "i": i}, lengths, np.ones(n))
        assert len(replay) == n
        with pytest.raises(gm.InvalidTrajectoryError, match="trajectory 0: trajectory has length 9"):
            replay.insert_packed({"x": np.zeros((9, 2)), "i": np.zeros(9, np.int64)}, [9])
        assert len(replay) == n
        got = replay.get_many(keys)
        for k, t in enumerate(got):
            np.testing.assert_array_equal(t["i"], i[lengths[:k].sum():lengths[:k + 1].sum()])
    finally:
        replay.close()

"""gm.datasets.from_minari on K ranks, over the datasets of tests/mpi/minari_datasets.py (written by minari's
own writer; their root in $MINARI_DATASETS_PATH). Run by tests/test_minari.py on 1 and 2 ranks; by hand:
``MINARI_DATASETS_PATH=/tmp/m mpiexec -n 2 python -m pytest tests/mpi/test_minari_ingest.py`` after
``minari_datasets.write_all(Path("/tmp/m"))``.

- Every episode of each dataset, fetched back from the replay (get_many), equals what ``minari.load_dataset``
  gives for it, exactly (values and dtypes): observations[:-1], observations[1:] as next_observations, actions,
  rewards, terminations, truncations; Dict observation spaces as one column per leaf; infos when named.
- The ranks hold disjoint contiguous runs of the episodes, balanced by steps, every episode once.
- The dataset is found by id (under $MINARI_DATASETS_PATH), by its directory and by its data/ directory.
- Bad input raises the same ValueError on every rank: no such dataset, a directory that is no Minari dataset,
  another storage format, main_data.hdf5 missing or truncated, a non-numeric column, an unknown column, an
  episode with mismatched lengths (found when read: the replay is closed), one rank with a bad path.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, expect_same_error

minari = pytest.importorskip("minari")
ROOT = Path(os.environ.get("MINARI_DATASETS_PATH", "/nonexistent"))
pytestmark = pytest.mark.skipif(not (ROOT / "cartpole").is_dir(),
                                reason="no datasets: set MINARI_DATASETS_PATH to minari_datasets.write_all's root")


def leaves(value, prefix: str) -> dict[str, np.ndarray]:
    """A Minari episode field as {column: array}: a dict of spaces flattened to ``prefix/key``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(leaves(v, f"{prefix}/{k}"))
        return out
    return {prefix: np.asarray(value)}


def expected(episode, infos=()) -> dict[str, np.ndarray]:
    """What from_minari should hold for one of minari's EpisodeData."""
    out = {}
    for name, obs in leaves(episode.observations, "observations").items():
        out[name] = obs[:-1]
        out["next_" + name] = obs[1:]
    out.update(leaves(episode.actions, "actions"))
    out.update(rewards=episode.rewards, terminations=episode.terminations, truncations=episode.truncations)
    for key in infos:
        out[f"infos/{key}"] = np.asarray(episode.infos[key])[1:]
    return out


def check_equals_minari(replay: gm.Replay, dataset_id: str, infos=()) -> None:
    episodes = list(minari.load_dataset(dataset_id).iterate_episodes())
    info = replay.dataset_info
    assert info["episodes"] == len(episodes) and not info["open_last_episode"]
    assert info["steps"] == sum(len(e) for e in episodes)
    assert info["metadata"]["dataset_id"] == dataset_id
    mine, first = info["episode_keys"], info["first_episode"]
    runs = COMM.allgather((first, len(mine)))
    assert [r[0] for r in runs] == list(np.cumsum([0] + [r[1] for r in runs])[:-1])  # contiguous, in rank order
    assert sum(r[1] for r in runs) == len(episodes)
    if SIZE > 1:
        assert all(r[1] > 0 for r in runs)
    got = replay.get_many(mine)  # this rank's own episodes
    assert len(got) == len(mine)
    for e, trajectory in zip(episodes[first:first + len(mine)], got):
        want = expected(e, infos)
        assert sorted(trajectory) == sorted(want), (sorted(trajectory), sorted(want))
        for name, arr in want.items():
            assert trajectory[name].dtype == arr.dtype, (name, trajectory[name].dtype, arr.dtype)
            np.testing.assert_array_equal(trajectory[name], arr, err_msg=f"episode {e.id}: {name}")


def test_cartpole_by_id_equals_minari():
    replay = gm.datasets.from_minari("cartpole/random-v0", COMM, sampler=gm.Fifo(), chunk_bytes=2048, seed=1)
    try:
        assert replay.spec.names == ("observations", "next_observations", "actions", "rewards", "terminations",
                                     "truncations")
        check_equals_minari(replay, "cartpole/random-v0")
        assert replay.spec.columns[2].dtype == np.int64  # Discrete actions keep their dtype
    finally:
        replay.close()


def test_pendulum_by_directory_equals_minari():
    for where in (ROOT / "pendulum" / "random-v0", ROOT / "pendulum" / "random-v0" / "data"):
        replay = gm.datasets.from_minari(where, COMM, sampler=gm.Uniform(), seed=2, max_length=64)
        try:
            assert replay.spec.max_length == 64
            check_equals_minari(replay, "pendulum/random-v0")
            assert replay.dataset_info["source"] == str(ROOT / "pendulum" / "random-v0" / "data")
        finally:
            replay.close()


def test_dict_space_and_infos_equal_minari():
    replay = gm.datasets.from_minari("dict/synthetic-v0", COMM, sampler=gm.Fifo(), chunk_bytes=64,
                                     columns=["observations/count", "observations/pos", "next_observations/count",
                                              "next_observations/pos", "actions", "rewards", "terminations",
                                              "truncations", "infos/step"])
    try:
        check_equals_minari(replay, "dict/synthetic-v0", infos=("step",))
    finally:
        replay.close()
    replay = gm.datasets.from_minari("dict/synthetic-v0", COMM, next_observations=False)
    try:
        assert replay.spec.names == ("observations/count", "observations/pos", "actions", "rewards", "terminations",
                                     "truncations")
    finally:
        replay.close()


@pytest.mark.parametrize("dataset,text", [
    ("nowhere/none-v0", "no such directory, and no local Minari dataset"),
    (str(ROOT / "bad" / "nometa"), "not a Minari dataset (no metadata.json"),
    ("bad/arrow-v0", "data_format 'arrow': only Minari's HDF5 storage is read"),
    ("bad/nomain-v0", "no main_data.hdf5"),
    ("bad/truncated-v0", "cannot be opened as HDF5 (truncated or damaged?)"),
    ("bad/text-v0", "column 'actions' has non-numeric dtype"),
    ("bad/ragged-v0", "episode_5/observations holds shape"),
])
def test_bad_dataset_fails_on_every_rank(dataset, text):
    expect_same_error(lambda: gm.datasets.from_minari(dataset, COMM), ValueError, text)


def test_unknown_column_and_one_bad_rank_fail_everywhere():
    expect_same_error(lambda: gm.datasets.from_minari("cartpole/random-v0", COMM, columns=["nope"]), ValueError,
                      "no column(s) ['nope']")
    bad = SIZE - 1
    where = "nowhere/none-v0" if RANK == bad else "cartpole/random-v0"
    expect_same_error(lambda: gm.datasets.from_minari(where, COMM), ValueError, f"from_minari: rank {bad}: ")

"""A checkpoint of format version 2 written by the code before the issue-10 refactor still loads.

``tests/fixtures/checkpoint_v2`` was written on 2 ranks by that code
(tests/fixtures/make_checkpoint_v2.py has how, and what it holds);
``checkpoint_v2.json`` records every live trajectory (key, id, length, priority,
times sampled, stamp, per shard in insertion order) and the batches each rank drew
right after the save.

- On 2 ranks: the exact restore holds every trajectory bit for bit under its old
  key, in the same order, with its priority, times sampled and stamp, and draws
  the recorded batches again.
- On each rank alone (a 1-rank communicator; on a singleton too), with room for
  both saved shards: the reshard holds every trajectory of both shards under its new key, with the same data,
  priority, times sampled and stamp, in global insertion order, and samples.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi import checkpoint as ck
from gear_mpi import keys as keyspace
from replay_checks import arrays

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHECKPOINT = str(FIXTURES / "checkpoint_v2")
SPEC = gm.TrajectorySpec({"obs": ((2,), "float32"), "id": ((), "int64"), "flag": ((), "uint8")}, max_length=5)


def traj(ident: int) -> dict[str, np.ndarray]:
    """The trajectory with id ``ident`` (the same function as in make_checkpoint_v2.py)."""
    rng = np.random.default_rng(ident)
    length = 1 + ident % SPEC.max_length
    return {"obs": rng.standard_normal((length, 2)).astype(np.float32),
            "id": np.full(length, ident, np.int64),
            "flag": rng.integers(0, 256, length).astype(np.uint8)}


@pytest.fixture(scope="module")
def ref() -> dict:
    with open(FIXTURES / "checkpoint_v2.json") as f:
        return json.load(f)


def rows(shard: gm.Shard) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, arr in shard.sections():
        out.setdefault(name, np.array(arr))
    return out


def check_holds(replay: gm.Replay, entries: list[dict], keys: list[int]) -> None:
    """Trajectory ``entries[i]`` is live under ``keys[i]`` with its data, priority, times sampled and stamp."""
    t = rows(replay.shard)
    for e, k in zip(entries, keys):
        got, want = replay.get(k), traj(e["id"])
        for c in SPEC.names:
            assert got[c].dtype == want[c].dtype and got[c].tobytes() == want[c].tobytes(), (e["id"], c)
        assert replay.shard.priorities([k])[0] == e["priority"], e
        slot = int(keyspace.decode(np.array([k], np.int64))[3][0])
        # uses are counted only under a max_times_sampled (the fixture has none: its counts are dropped)
        times = e["times_sampled"] if replay.shard.max_times_sampled else 0
        assert int(t["times_sampled"][slot]) == times and int(t["stamp"][slot]) == e["stamp"], e


def test_the_fixture_is_format_version_2():
    doc = ck.read_manifest(CHECKPOINT)
    assert doc["version"] == 2 and ck.FORMAT_VERSION == 3 and doc["body"]["ranks"] == 2


@pytest.mark.skipif(SIZE != 2, reason="an exact restore needs the 2 ranks it was saved on")
def test_exact_restore_of_the_fixture(ref):
    replay, (old, new) = gm.Replay.load(CHECKPOINT, timeout=30.0)
    mine = ref["shards"][RANK]
    everything = sorted(e["key"] for shard in ref["shards"] for e in shard)
    assert old.tolist() == everything and new.tolist() == everything
    assert replay.shard.live_keys().tolist() == [e["key"] for e in mine]
    check_holds(replay, mine, [e["key"] for e in mine])
    nb = ref["next_batches"]
    for align, want in zip(nb["aligns"], nb["per_rank"][RANK]):
        b = arrays(replay.sample(2 + RANK, nb["window"], align))
        assert b["keys"].tolist() == want["keys"] and b["lengths"].tolist() == want["lengths"]
        # the fixture was written when the index held float64 weights; it now holds them rounded to float32
        # (issue 34): the same draws, probabilities and importance weights within float32 precision
        np.testing.assert_allclose(b["probabilities"], want["probabilities"], rtol=2.0 ** -21, atol=0)
        np.testing.assert_allclose(b["weights"], want["weights"], rtol=2.0 ** -21, atol=0)
        assert b["mask"].astype(int).tolist() == want["mask"]
        assert b["id"].tolist() == want["id"]
        assert np.array_equal(b["obs"], np.array(want["obs"], np.float32))
    replay.close()


def test_reshard_of_the_fixture_onto_one_rank(ref):
    alone = COMM.Split(RANK, 0)  # every rank loads the whole checkpoint by itself
    replay, key_map = gm.Replay.load(CHECKPOINT, alone, timeout=30.0, capacity_steps=48)  # 47 steps saved
    entries = [e for shard in ref["shards"] for e in shard]
    new = ck.remap(key_map, [e["key"] for e in entries])
    assert (new >= 0).all() and len(key_map[0]) == len(entries)
    check_holds(replay, entries, new.tolist())
    # one shard in global insertion order: each old shard's order, merged by stamp
    order = replay.shard.live_keys().tolist()
    assert sorted(order) == sorted(new.tolist())
    position = {k: i for i, k in enumerate(order)}
    for shard in ref["shards"]:
        mapped = ck.remap(key_map, [e["key"] for e in shard]).tolist()
        assert [position[k] for k in mapped] == sorted(position[k] for k in mapped)
    stamps = [e["stamp"] for e in sorted(entries, key=lambda e: position[int(new[entries.index(e)])])]
    assert stamps == sorted(stamps)
    b = arrays(replay.sample(4, 2))
    assert set(b["id"][b["mask"]].tolist()) <= {e["id"] for e in entries}
    replay.close()
    alone.Free()

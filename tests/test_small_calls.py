"""The per-call paths of small batches (issue 34 item 2).

- ``Shard.append_step`` stores what ``insert_packed`` of one one-step item stores, and refuses a bad step
  (missing, unknown, non-numeric, uncastable, misshapen column; bad priority) before anything changes.
- A one-rank host ``Replay`` samples through its shard: no collective head is sent, the arguments are still
  checked with the same errors, every mode works.
- ``Batch.column_addresses`` are the addresses of the column buffers, for new batches and for others.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((4,), "float32"), "action": ((1,), "int64"), "reward": ((), "float32")},
                         max_length=1)


def step(i: int) -> dict:
    return {"obs": np.full(4, i, np.float32), "action": np.array([i % 3]), "reward": np.float32(i / 2)}


def state(shard: gm.Shard) -> list[np.ndarray]:
    out = [a.copy() for a in shard.store.table] + [c.copy() for c in shard.store.columns.values()]
    if shard.index is not None:
        out += [a.copy() for a in shard.index.tree]
    return out


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4)])
def test_append_step_stores_what_insert_packed_stores(sampler):
    a, b = gm.Shard(SPEC, 8, sampler, seed=0), gm.Shard(SPEC, 8, sampler, seed=0)
    for i in range(13):  # wraps the ring: evictions too
        p = 1.0 if i % 2 else 0.5 + i
        one = {k: np.asarray(v)[None] for k, v in step(i).items()}
        ka = a.append_step(step(i) if i % 3 else one, priority=p)  # the step's shape or a leading 1
        kb = b.insert_packed(one, np.ones(1, np.int64), np.array([p]))
        assert isinstance(ka, int)
        for x, y in zip(a.get(ka).values(), b.get(int(kb[0])).values()):  # each shard has its own key tag
            np.testing.assert_array_equal(x, y)
    for name, x, y in zip(a.store.table._fields, a.store.table, b.store.table):
        if name != "stamp":  # insertion times differ
            np.testing.assert_array_equal(x, y, err_msg=name)
    for x, y in zip(state(a)[len(a.store.table):], state(b)[len(b.store.table):]):
        np.testing.assert_array_equal(x, y)
    got = a.get(ka)
    np.testing.assert_array_equal(got["obs"], np.full((1, 4), 12, np.float32))


def test_append_step_casts_and_takes_tensors_and_lists():
    shard = gm.Shard(SPEC, 8, seed=0)
    key = shard.append_step({"obs": torch.arange(4, dtype=torch.float32), "action": [2], "reward": 1})
    got = shard.get(key)
    np.testing.assert_array_equal(got["obs"][0], [0, 1, 2, 3])
    assert got["action"][0, 0] == 2 and got["reward"][0] == 1.0


@pytest.mark.parametrize("bad, match", [
    ({"obs": np.zeros(4, np.float32), "action": np.zeros(1, np.int64)}, "missing column"),
    (dict(step(0), extra=np.zeros(1)), "unknown column"),
    (dict(step(0), obs=np.zeros(5, np.float32)), "column 'obs' has shape"),
    (dict(step(0), obs=np.zeros((2, 4), np.float32)), "column 'obs' has shape"),
    (dict(step(0), action=np.zeros(1, np.float64)), "column 'action' has dtype float64"),
    (dict(step(0), reward=np.complex64(1)), "column 'reward' has dtype complex64"),
    (dict(step(0), obs=np.array(["a"] * 4)), "column 'obs' has dtype"),
    ([1, 2, 3], "expected a mapping"),
])
def test_append_step_refuses_a_bad_step_and_changes_nothing(bad, match):
    shard = gm.Shard(SPEC, 8, gm.Prioritized(), seed=0)
    shard.append_step(step(1))
    before = state(shard)
    with pytest.raises(gm.InvalidTrajectoryError, match=match):
        shard.append_step(bad)
    for x, y in zip(before, state(shard)):
        np.testing.assert_array_equal(x, y)
    assert len(shard) == 1


@pytest.mark.parametrize("priority", [float("nan"), -1.0, float("inf"), "high"])
def test_append_step_refuses_a_bad_priority(priority):
    shard = gm.Shard(SPEC, 8, gm.Prioritized(), seed=0)
    before = state(shard)
    with pytest.raises(gm.InvalidPriorityError):
        shard.append_step(step(0), priority=priority)
    for x, y in zip(before, state(shard)):
        np.testing.assert_array_equal(x, y)


def test_one_rank_replay_samples_without_a_head():
    """One host rank: nobody to agree with, so no collective head (the old path sent one per sample)."""
    with gm.Replay(SPEC, 64, gm.Prioritized(0.6, 0.4), seed=0) as replay:
        for i in range(40):
            replay.shard.append_step(step(i), priority=1.0 + i)
        heads = replay.calls.count
        for mode in (None, "decentralized", "centralized", "local"):
            batch = replay.sample(16, 1, mode=mode)
            assert batch.keys.shape == (16,) and bool(batch.mask.all())
            assert float(batch.weights.max()) <= 1.0
            np.testing.assert_array_equal(batch["obs"][:, 0, 1].numpy(), batch["reward"][:, 0].numpy() * 2)
        assert replay.calls.count == heads
        out = replay.sample(16, 1)
        assert replay.sample(16, 1, out=out) is out
        with pytest.raises(ValueError, match="mode"):
            replay.sample(16, 1, mode="everywhere")
        with pytest.raises(ValueError, match="out="):
            replay.sample(8, 1, out=out)
        with pytest.raises(ValueError):
            replay.sample(-1, 1)
        assert replay.update_priorities(out.keys, np.ones(16)) == 16  # still the collective update


def test_one_rank_replay_empty_raises():
    with gm.Replay(SPEC, 64, seed=0) as replay:
        with pytest.raises(gm.EmptyReplayError):
            replay.sample(4, 1)
        assert len(replay.sample(0, 1).keys) == 0


def test_batch_column_addresses():
    new = gm.Batch.empty(SPEC, 8, 1)
    other = new.squeeze()
    for batch in (new, other):
        got = batch.column_addresses()
        assert got.dtype == np.int64
        assert got.tolist() == [v.ctypes.data for v in batch.byte_views()]

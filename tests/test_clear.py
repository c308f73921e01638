"""Shard.clear(): every trajectory removed at once (what TorchRL's ``rb.empty()`` asks of a storage).

After a clear: nothing can be sampled, every key issued before is stale (``get`` raises StaleKeyError, an
update counts it stale), ``stats()`` counts the trajectories as removed, and the shard takes new
trajectories and samples them as a new shard would, for both an ordered and a proportional selector.
(``Replay.clear()`` on K ranks: tests/mpi/test_torchrl_adapter.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm


@pytest.mark.parametrize("selector", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo()], ids=repr)
def test_clear_removes_everything_and_the_shard_starts_again(shard_factory, spec, make_traj, selector):
    shard = shard_factory(spec, 64, selector, max_items=10)
    old = shard.insert_many([make_traj(n) for n in (5, 7, 3, 9)], [1.0, 2.0, 3.0, 4.0])
    shard.sample(3, 4)
    before = shard.stats()

    assert shard.clear() == 4
    assert len(shard) == 0 and shard.stats()["live_steps"] == 0 and shard.total_weight == 0.0
    with pytest.raises(gm.EmptyReplayError):
        shard.sample(1, 4)
    for k in old:
        with pytest.raises(gm.StaleKeyError):
            shard.get(int(k))
    assert shard.update_priorities(old, np.ones(len(old))) == 0
    after = shard.stats()
    assert after["removed"] == before["removed"] + 4 and after["evicted"] == before["evicted"]
    assert after["inserted"] == before["inserted"] and after["capacity_steps"] == 64

    # a full shard's worth again: the freed slots and steps are all reusable, the old keys stay stale
    fresh = [make_traj(n) for n in (16, 16, 16, 16)]
    new = shard.insert_many(fresh)
    assert len(shard) == 4 and not set(new.tolist()) & set(old.tolist())
    for k, traj in zip(new, fresh):
        assert np.array_equal(shard.get(int(k))["t"], traj["t"])
    batch = shard.sample(32, 16)
    steps = {int(t) for traj in fresh for t in traj["t"]}
    assert set(batch["t"][batch.mask].tolist()) <= steps
    assert shard.clear() == 4 and shard.clear() == 0  # clearing an empty shard is a no-op


def test_clear_with_removed_items_still_in_the_ring(shard_factory, spec, make_traj):
    """Items removed by max_times_sampled may still hold ring steps; a clear releases them too."""
    shard = shard_factory(spec, 64, gm.Uniform(), max_times_sampled=1)
    shard.insert_many([make_traj(4) for _ in range(6)])
    shard.sample(2, 4)  # up to two removed, possibly in the middle of the ring
    live = len(shard)
    assert shard.clear() == live
    assert shard.stats()["steps_used"] == 0
    shard.insert_many([make_traj(16) for _ in range(4)])  # the whole ring again
    assert len(shard) == 4


def test_clear_on_a_closed_shard_raises(spec):
    shard = gm.Shard(spec, 32)
    shard.close()
    with pytest.raises(RuntimeError, match="closed"):
        shard.clear()

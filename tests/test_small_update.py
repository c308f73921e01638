"""``Shard.update_priorities`` of a few keys in one kernel call (gear_mpi.selection.small_update, issue 34):
the same leaves, levels, raw priorities and stale count as the general path (``apply_priorities``), with
duplicate, stale, zero and -0.0 priorities; bad input raises the general path's errors and changes nothing;
larger updates and other selectors still take the general path.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gear_mpi as gm
from gear_mpi.kernels import priority_tree
from gear_mpi.spec import validate_priorities

SPEC = gm.TrajectorySpec({"obs": ((2,), "float32")}, max_length=3)


def filled(sampler, n=3000, one_priority=False):
    shard = gm.Shard(SPEC, 4000, sampler, max_items=2000, seed=0, tag=5)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4, n)
    obs = rng.standard_normal((lengths.sum(), 2)).astype(np.float32)
    prio = rng.random(n) + 0.1
    for lo in range(0, n, 1000):  # wraps: evicted keys are stale
        hi = lo + 1000
        a, b = lengths[:lo].sum(), lengths[:hi].sum()
        shard.insert_packed({"obs": obs[a:b]}, lengths[lo:hi], None if one_priority else prio[lo:hi])
    return shard


def state(shard):
    out = {k: np.array(v) for k, v in zip(shard.index.tree._fields, shard.index.tree)}
    row = shard.store.layout.priority
    if isinstance(row, np.ndarray):
        out["raw"] = row.copy()
    out["stale"] = np.array(shard.stale_updates)
    return out


def general(shard, keys, priorities):
    """What update_priorities did before: validate, then apply_priorities."""
    keys = np.asarray(keys, np.int64)
    return int(shard.apply_priorities(keys, validate_priorities(priorities, len(keys))).sum())


@pytest.mark.parametrize("sampler", [gm.Prioritized(0.6, 0.4), gm.Prioritized(1.0, 0.4), gm.Prioritized(0.5, 1.0),
                                     gm.Uniform()], ids=repr)
def test_few_keys_update_as_the_general_path(sampler):
    a, b = filled(sampler), filled(sampler)
    rng = np.random.default_rng(1)
    live = a.live_keys()
    stale = np.setdiff1d(a.store.keys_of(np.arange(2000)), live)[:20]  # evicted: their slots' old generations
    assert len(stale)
    for it in range(60):
        nb = int(rng.choice([1, 7, 32, 64, priority_tree.SET_SERIAL_MAX]))
        keys = rng.choice(live, nb)  # duplicates too
        if it % 5 == 0:
            keys[: min(3, nb)] = rng.choice(stale, min(3, nb))
        pr = rng.random(nb) * 3
        pr[rng.random(nb) < 0.1] = 0.0
        pr[rng.random(nb) < 0.05] = -0.0
        got = a.update_priorities(torch.from_numpy(keys) if it % 2 else keys, pr if it % 3 else list(pr))
        assert got == general(b, keys, pr)
        sa, sb = state(a), state(b)
        for name in sa:
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=f"update {it}: {name}")
    np.testing.assert_array_equal(a.priorities(live), b.priorities(live))


@pytest.mark.parametrize("bad, error", [
    (lambda k, p: (k, np.where(np.arange(len(p)) == 5, np.nan, p)), gm.InvalidPriorityError),
    (lambda k, p: (k, np.where(np.arange(len(p)) == 9, -1.0, p)), gm.InvalidPriorityError),
    (lambda k, p: (k, np.where(np.arange(len(p)) == 0, np.inf, p)), gm.InvalidPriorityError),
    (lambda k, p: (k, p[:-1]), gm.InvalidPriorityError),
    (lambda k, p: (np.where(np.arange(len(k)) == 7, k ^ (1 << 60), k), p), gm.InvalidKeyError),
    (lambda k, p: (np.where(np.arange(len(k)) == 7, -1, k), p), gm.InvalidKeyError),
    (lambda k, p: (k.astype(np.float64), p), TypeError),
])
def test_bad_input_raises_and_changes_nothing(bad, error):
    shard = filled(gm.Prioritized(0.6, 0.4))
    keys = shard.live_keys()[:32]
    before = state(shard)
    k, p = bad(keys, np.ones(32))
    with pytest.raises(error):
        shard.update_priorities(k, p)
    after = state(shard)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_uniform_row_standing_for_one_value_is_materialized():
    a, b = filled(gm.Uniform(), one_priority=True), filled(gm.Uniform(), one_priority=True)
    assert a.store.layout.priority_constant == 1.0  # the row stands for the inserts' one value
    keys = a.live_keys()[:16]
    pr = np.linspace(0.5, 2.0, 16)
    assert a.update_priorities(keys, pr) == general(b, keys, pr) == 16
    np.testing.assert_array_equal(a.priorities(keys), pr)
    np.testing.assert_array_equal(a.store.layout.priority, b.store.layout.priority)
    assert a.update_priorities(keys[:3], [0.25, 0.25, 0.25]) == 3  # now through the kernel: the row is kept
    np.testing.assert_array_equal(a.priorities(keys[:3]), [0.25] * 3)


def test_large_updates_and_ordered_selectors_take_the_general_path():
    shard = filled(gm.Prioritized(0.6, 0.4))
    keys = shard.live_keys()[:priority_tree.SET_SERIAL_MAX + 1]
    assert shard.update_priorities(keys, np.full(len(keys), 2.0)) == len(keys)
    np.testing.assert_array_equal(shard.priorities(keys), 2.0)
    fifo = filled(gm.Fifo())
    assert fifo.update_priorities(fifo.live_keys()[:4], [1.0, 2.0, 3.0, 4.0]) == 4
    np.testing.assert_array_equal(fifo.priorities(fifo.live_keys()[:4]), [1.0, 2.0, 3.0, 4.0])

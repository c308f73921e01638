"""Bookkeeping that is derived instead of stored (issue 34, item 4): float32 leaves under float64 levels in the
priority index, and insertion stamps kept along the insertion order (a StampLog) instead of one per slot."""
from __future__ import annotations

import time

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.kernels import priority_tree as tree
from gear_mpi.kernels import ring
from gear_mpi.selection import PriorityIndex

SPEC = gm.TrajectorySpec({"x": ((), np.float32)}, max_length=1)


class Clock:
    """A fake ``time.time_ns``: each call a new, larger value (so each insert has its own stamp)."""

    def __init__(self):
        self.now = 1_000

    def __call__(self) -> int:
        self.now += 1_000
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "time_ns", c)
    return c


def section(shard: gm.Shard, name: str) -> np.ndarray:
    return dict(shard.store.table_sections())[name]


def slots_of(keys) -> np.ndarray:
    return np.asarray(keys, np.int64) & ((1 << 27) - 1)


# ---- stamps -------------------------------------------------------------------------------------
def test_a_prioritized_table_keeps_each_inserts_stamp_without_a_row(clock):
    shard = gm.Shard(SPEC, 50, gm.Prioritized(0.6, 0.4), seed=0)
    try:
        assert shard.store.stamp.strides == (0,) and shard.store.layout.stamp_log is not None
        want = {}
        for size in (3, 1, 7, 2, 30, 20):  # the last ones wrap the ring and evict the first
            keys = shard.insert_packed({"x": np.zeros(size, np.float32)}, np.ones(size, np.int64), np.ones(size))
            for s in slots_of(keys).tolist():
                want[s] = clock.now
        stamps, alive = section(shard, "stamp"), section(shard, "alive")
        live = np.flatnonzero(alive == ring.LIVE)
        assert len(live) == 50
        assert stamps[live].tolist() == [want[s] for s in live.tolist()]
    finally:
        shard.close()


def test_fifo_and_lifo_keep_a_stamp_per_slot():
    for sampler in (gm.Fifo(), gm.Lifo()):
        shard = gm.Shard(SPEC, 8, sampler)
        try:
            assert shard.store.stamp.strides == (8,) and shard.store.layout.stamp_log is None
        finally:
            shard.close()


def test_the_stamp_log_stays_bounded_under_one_item_inserts(clock):
    """1000 inserts of one item into 256 slots: at most max_items // 64 + 64 anchors; every stamp read back
    is one of an insert at or before the item's own (never later), non-decreasing along the insertion order,
    and the newest insert's exact."""
    shard = gm.Shard(SPEC, 256, gm.Prioritized(0.6, 0.4), seed=0)
    try:
        log = shard.store.layout.stamp_log
        truth = {}
        for _ in range(1000):
            k = shard.insert_packed({"x": np.zeros(1, np.float32)}, np.ones(1, np.int64), np.ones(1))
            truth[int(slots_of(k)[0])] = clock.now
            assert log.count <= log.limit == 256 // 64 + 64
        order = shard.store.live_slots()
        got = section(shard, "stamp")[order]
        assert (np.diff(got) >= 0).all()
        assert (got <= np.array([truth[s] for s in order.tolist()])).all()
        assert got[-1] == truth[int(order[-1])]
        assert log.nbytes <= 2 * 16 * log.limit
    finally:
        shard.close()


def test_stamps_given_back_by_a_reshard_and_a_saved_shard_are_kept(tmp_path, clock):
    shard = gm.Shard(SPEC, 40, gm.Prioritized(0.6, 0.4), seed=0, tag=5)
    try:
        keys = shard.insert_packed({"x": np.arange(12, dtype=np.float32)}, np.ones(12, np.int64), np.ones(12))
        given = np.array([5, 5, 5, 9, 9, 11, 11, 11, 11, 20, 20, 30], np.int64) * 10 ** 9
        shard.restore_history(keys, given, np.zeros(12, np.int64))
        assert section(shard, "stamp")[slots_of(keys)].tolist() == given.tolist()
        more = shard.insert_packed({"x": np.zeros(2, np.float32)}, np.ones(2, np.int64), np.ones(2))
        gm.save_shard(shard, tmp_path / "s.npz")
        back = gm.load_shard(tmp_path / "s.npz")
        try:
            assert section(back, "stamp")[slots_of(keys)].tolist() == given.tolist()
            assert section(back, "stamp")[slots_of(more)].tolist() == [clock.now] * 2
        finally:
            back.close()
    finally:
        shard.close()


# ---- float32 leaves -----------------------------------------------------------------------------
def test_leaves_are_float32_values_summed_in_float64():
    rng = np.random.default_rng(3)
    n = 5000
    w = rng.random(n) ** 3 * 7.0
    w[:3] = [1e-50, 1e300, 0.0]  # below float32's range (stays positive), above it (stays finite), empty
    index = PriorityIndex(n)
    index.set(np.arange(n, dtype=np.int64), w)
    held = index.leaves.astype(np.float64)
    assert index.leaves.dtype == np.float32 and index.l0_sum.dtype == np.float64
    np.testing.assert_array_equal(held, tree.leaf_values(w))
    assert held[0] == tree.LEAF_TINY and held[1] == tree.LEAF_MAX and held[2] == 0.0
    assert np.all(np.abs(held[3:] - w[3:]) <= w[3:] * 2.0 ** -24)
    ref = PriorityIndex(n)  # the levels are a function of the leaves: a rebuild gives the same structure
    ref.leaves[:] = index.leaves
    ref.rebuild()
    for name in tree.TREE_FIELDS:
        np.testing.assert_array_equal(getattr(ref, name), getattr(index, name), err_msg=name)
    assert index.total == pytest.approx(held.sum(), rel=1e-12)


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.25, 2.0])
def test_priorities_read_back_within_float32_precision_and_stable(alpha):
    rng = np.random.default_rng(5)
    p = np.concatenate([rng.uniform(0.0, 10.0, 3000), [1e-9, 1e9, 0.5, 0.625, 3.0, 1.0]])
    shard = gm.Shard(SPEC, len(p), gm.Prioritized(alpha, 0.4), seed=0)
    try:
        keys = shard.insert_packed({"x": np.zeros(len(p), np.float32)}, np.ones(len(p), np.int64), p)
        got = shard.priorities(keys)
        assert np.all(np.abs(got - p) <= p * 2.0 ** -22 / min(alpha, 1.0))
        assert got[-4:].tolist() == [0.5, 0.625, 3.0, 1.0]  # short mantissas read back exactly
        leaves = shard.index.leaves.copy()
        shard.update_priorities(keys, got)  # setting what was read back changes nothing
        np.testing.assert_array_equal(shard.index.leaves, leaves)
        np.testing.assert_array_equal(shard.priorities(keys), got)
    finally:
        shard.close()


def test_float64_leaves_of_older_checkpoints_are_rounded_and_the_levels_rebuilt():
    """Checkpoints written before the leaves were float32 hold float64 leaves and the levels summed from them:
    a load rounds the leaves and recomputes the levels instead of taking them as saved."""
    rng = np.random.default_rng(9)
    n = 700
    w = rng.random(n)
    old = {"leaves": w.copy()}
    old.update({name: np.full(getattr(PriorityIndex(n), name).shape, 123.0) for name in tree.TREE_FIELDS[1:]})
    index = PriorityIndex(n)
    index.restore(old, n)
    want = PriorityIndex(n)
    want.set(np.arange(n, dtype=np.int64), w)
    for name in tree.TREE_FIELDS:
        np.testing.assert_array_equal(getattr(index, name), getattr(want, name), err_msg=name)
    fresh = PriorityIndex(n)  # sections saved now (float32 leaves) load as saved, levels and all
    fresh.restore(dict(index.sections(n)), n)
    for name in tree.TREE_FIELDS:
        np.testing.assert_array_equal(getattr(fresh, name), getattr(index, name), err_msg=name)
    with pytest.raises(ValueError, match="float32 or float64"):
        PriorityIndex(n).restore({"leaves": w.astype(np.float16)}, n)


def test_the_memory_budget_counts_the_rows_a_prioritized_shard_keeps():
    """The paper's N = 1e9 one-step 4-byte items on one 24 GiB node (8 ranks of 1.25e8 slots) passes the
    budget check: 4 B of data + 14 of table (a use count included: the check does not know the limit) + 6 of
    index a slot, against 44 B with the widest table."""
    from gear_mpi.storage import budget
    per_rank = 125_000_000
    need = budget.shard_bytes(SPEC, per_rank, None, True, "private", gm.Prioritized(0.6, 0.4))
    header = 4096  # the arena's header, at most
    assert 0 <= need - per_rank * 24 <= header and 8 * need <= 24 * 2 ** 30
    widest = budget.shard_bytes(SPEC, per_rank, None, True, "private")  # no sampler: the widest table
    assert 0 <= widest - per_rank * 44 <= header
    fifo = budget.shard_bytes(SPEC, per_rank, None, False, "private", gm.Fifo())
    assert 0 <= fifo - per_rank * (4 + 10 + 8 + 8 + 4) <= header

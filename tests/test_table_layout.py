"""The trajectory table's narrow layout (gear_mpi.storage.table): bytes per item, ranges, casts."""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import table as table_layout
from gear_mpi.kernels import ring
from gear_mpi.keys import GEN_MASK

TARGET_BYTES_PER_ITEM = 20  # issue 34, item 4 (was 32, issue 16 part 5): a 1e7-item shard of one-step 4-byte items


def test_a_1e7_item_prioritized_shard_holds_at_most_20_bytes_an_item():
    """Counted from the arrays' sizes (not RSS): columns + table + priority index + stamp log, per item."""
    n = 10_000_000
    spec = gm.TrajectorySpec({"x": ((), np.float32)}, max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4))
    try:
        st = shard.store
        table = sum(int(a.nbytes) if a.strides[0] else int(a.itemsize) for a in st.table)
        assert table == st.table_bytes
        columns = sum(int(c.nbytes) for c in st.columns.values())
        log = st.layout.stamp_log
        assert log is not None and log.limit * 16 <= n // 4 + 4096  # at most 0.25 B a slot, when full
        per_item = (columns + table + shard.index.nbytes + log.limit * 16) / n
        assert per_item <= TARGET_BYTES_PER_ITEM, per_item
        assert st.priority is not None and not isinstance(st.priority, np.ndarray)  # read back from the index
        assert table_layout.bytes_per_slot(n, n, 1, 0, False, stamp_row=False) == 10
        assert table_layout.bytes_per_slot(n, n, 1, 0, False) == 18  # Fifo/Lifo keep a stamp per slot
        assert shard.index.leaves.dtype == np.float32 and shard.index.nbytes < 5.3 * n
        assert shard.stats()["reserved_bytes"] <= TARGET_BYTES_PER_ITEM * n + st.arena.nbytes - columns
    finally:
        shard.close()


def test_row_types_follow_the_ranges():
    rows = table_layout.row_types(2 ** 32 - 1, 1000, 1, 0)
    assert rows["start"][1] == np.uint32 and rows["length"][2] and not rows["start"][2]
    assert rows["times_sampled"][2]  # no use limit: not stored
    rows = table_layout.row_types(2 ** 32 + 5, 1000, 300, 2 ** 32)
    assert rows["start"][1] == np.int64 and rows["length"][1] == np.uint16 and rows["times_sampled"][1] == np.int64
    assert table_layout.row_types(100, 10, 70_000, 3)["length"][1] == np.uint32
    assert table_layout.row_types(100, 10, 2 ** 32, 3)["times_sampled"][1] == np.uint32
    assert all(table_layout.row_types(100, 10, 5, 1)[k][1] == dt for k, dt in
               (("status", np.uint16), ("order", np.int32), ("stamp", np.int64)))


def test_more_than_2_to_the_32_ring_steps_keep_exact_starts():
    """The kernels on a table for a ring past 2**32 steps (the rows only: no step memory is needed)."""
    cap = 2 ** 32 + 10
    rows = table_layout.row_types(cap, 8, 3, 0)
    t = table_layout.build(rows, 8)
    assert t.start.dtype == np.int64
    t.state[ring.STEP_HEAD] = cap - 4  # an empty ring whose head sits near its top
    slots = np.empty(3, np.int64)
    ring.plan_insert(tuple(t), cap, np.array([3, 3, 3], np.int64), 7, slots, np.empty(3, np.int64))
    assert t.start[slots].tolist() == [cap - 4, cap - 1, 2]
    assert int(t.state[ring.STEPS_USED]) == 9


def test_generations_wrap_where_keys_wrap_and_keys_stay_distinct():
    """A slot reused 2**14 + 1 times: its generation counts modulo 2**14, as the key's field always did."""
    spec = gm.TrajectorySpec({"x": ((), np.float32)}, max_length=1)
    shard = gm.Shard(spec, 1, gm.Uniform(), tag=5)
    try:
        first = shard.insert({"x": np.zeros(1, np.float32)})
        for _ in range(GEN_MASK):
            last = shard.insert({"x": np.zeros(1, np.float32)})
        assert (shard.store.status[0] & GEN_MASK) == GEN_MASK and last != first
        assert np.array_equal(shard.priorities([first, last]) > 0, [False, True])
        again = shard.insert({"x": np.ones(1, np.float32)})
        assert again == first and shard.get(again)["x"][0] == 1.0  # the key field's 14 bits wrapped
    finally:
        shard.close()


def test_int64_sections_of_older_checkpoints_are_cast(make_traj, spec):
    """Format 2 and 3 saved every integer row as int64: a load casts them into the narrow rows."""
    a = gm.Shard(spec, 60, gm.Prioritized(0.7, 0.5), max_items=9, max_times_sampled=4, seed=1, tag=3)
    b = gm.Shard(spec, 60, gm.Prioritized(0.7, 0.5), max_items=9, max_times_sampled=4, seed=1, tag=3)
    try:
        for i in range(14):
            a.insert(make_traj(1 + i % 5), priority=0.25 * (1 + i % 3))
        a.sample(10, 2)
        wide = {}
        for name, arr in a.store.table_sections():
            arr = arr.astype(np.int64) if arr.dtype.kind in "iu" else arr
            wide[name] = np.concatenate([wide[name], arr]) if name in wide else arr
        b.store.restore_table(a.store.state[:ring.STATE_SIZE].astype(np.int64), wide)
        b.index.restore(dict(a.index.sections(int(a.store.state[ring.NEXT_FRESH]))), int(a.store.state[ring.NEXT_FRESH]))
        for name in ring.TABLE_FIELDS:
            if name != "stamp":  # no stamp row (Prioritized): the stamps are compared as sections below
                np.testing.assert_array_equal(getattr(b.store, name), getattr(a.store, name), err_msg=name)
        saved = dict(a.store.table_sections())
        np.testing.assert_array_equal(dict(b.store.table_sections())["stamp"], saved["stamp"])
        keys = a.store.keys_of(a.store.live_slots())
        np.testing.assert_array_equal(b.priorities(keys), a.priorities(keys))
        assert set(a.priorities(keys).tolist()) <= {0.25, 0.5, 0.75}  # set values read back exactly
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Fifo(), gm.Prioritized(0.0, 0.4)])
def test_selectors_whose_index_cannot_give_priorities_back_keep_them(spec, make_traj, sampler):
    shard = gm.Shard(spec, 40, sampler, tag=2)
    try:
        k = shard.insert(make_traj(2), priority=0.3)
        assert isinstance(shard.store.priority, np.ndarray) and shard.priorities([k])[0] == 0.3
    finally:
        shard.close()

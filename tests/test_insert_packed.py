"""Shard.insert_packed: many trajectories laid end to end, one array per column.

- It stores exactly what insert_many stores for the same trajectories (keys, steps,
  priorities, tables, index), whatever the dtypes (casts happen in the ring copy) or the
  container (numpy, torch, lists), evicting the oldest the same way.
- It refuses what insert_many refuses, with the same error class, and then stores
  nothing: every table array, every step column and the index are unchanged.
- Big batches (the index rebuilt from its leaves) and small ones (per-slot updates) give
  the very index that setting every leaf one by one gives.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import gear_mpi as gm
from gear_mpi.kernels import ring
from gear_mpi.selection import PriorityIndex
from gear_mpi.storage import shard_insert


def pack(trajs):
    """The packed form of a list of trajectories: concatenated columns and their lengths."""
    cols = {k: np.concatenate([t[k] for t in trajs]) for k in trajs[0]}
    return cols, np.array([len(t["t"]) for t in trajs])


def snapshot(shard: gm.Shard) -> list[np.ndarray]:
    """Copies of everything an insert may change."""
    out = [a.copy() for a in shard.store.table]
    out += [c.copy() for c in shard.store.columns.values()]
    if shard.index is not None:
        out += [a.copy() for a in shard.index.tree]
    return out


def same_state(a: gm.Shard, b: gm.Shard) -> None:
    """Both shards hold the same tables (stamps aside), steps and index, bit for bit."""
    for name, x, y in zip(a.store.table._fields, a.store.table, b.store.table):
        if name != "stamp":
            np.testing.assert_array_equal(x, y, err_msg=name)
    for name in a.store.columns:
        np.testing.assert_array_equal(a.store.columns[name], b.store.columns[name], err_msg=name)
    if a.index is not None:
        for name, x, y in zip(a.index.tree._fields, a.index.tree, b.index.tree):
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo()], ids=repr)
def test_packed_stores_what_insert_many_stores(spec, make_traj, shard_factory, sampler):
    rng = np.random.default_rng(5)
    a = shard_factory(spec, 120, sampler, max_items=20)
    b = shard_factory(spec, 120, sampler, max_items=20)
    for round_ in range(12):  # enough to wrap the ring and the table many times
        trajs = [make_traj(int(n)) for n in rng.integers(1, 17, rng.integers(1, 8))]
        pr = rng.uniform(0.0, 3.0, len(trajs))
        cols, lengths = pack(trajs)
        ka = a.insert_many(trajs, pr)
        kb = b.insert_packed(cols, lengths, pr)
        np.testing.assert_array_equal(ka, kb)
        same_state(a, b)
    for k in kb:
        got = b.get(int(k))
        want = a.get(int(k))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_packed_casts_and_takes_any_container(spec, make_traj, shard_factory):
    trajs = [make_traj(n) for n in (3, 16, 1, 7)]
    cols, lengths = pack(trajs)
    ref = shard_factory(spec, 64)
    ref.insert_packed(cols, lengths)
    variants = [
        {**cols, "obs": cols["obs"].astype(np.float64), "t": cols["t"].astype(np.int32)},  # cast in the copy
        {k: torch.from_numpy(v) for k, v in cols.items()},
        {**cols, "done": cols["done"].tolist(), "obs": np.asfortranarray(cols["obs"])},
        {**cols, "obs": np.repeat(cols["obs"], 2, axis=0)[::2]},  # a strided view
    ]
    for cols_v in variants:
        s = shard_factory(spec, 64)
        keys = s.insert_packed(cols_v, torch.as_tensor(lengths), torch.ones(4))
        assert keys.dtype == np.int64 and len(keys) == 4
        for name in ref.store.columns:
            np.testing.assert_array_equal(s.store.columns[name], ref.store.columns[name], err_msg=name)
    s = shard_factory(spec, 64)
    assert len(s.insert_packed({k: v[:0] for k, v in cols.items()}, [])) == 0 and len(s) == 0


def test_one_step_items_and_full_replacement(shard_factory):
    spec = gm.TrajectorySpec({"x": ((2,), np.float32), "i": ((), np.int64)}, max_length=4)
    n = 4096
    s = shard_factory(spec, n, gm.Prioritized(1.0, 0.4))
    for r in range(3):  # each batch evicts the whole previous one
        i = np.arange(r * n, (r + 1) * n)
        keys = s.insert_packed({"x": np.stack([i, -i], 1).astype(np.float32), "i": i}, np.ones(n, np.int64),
                               np.full(n, 2.0))
        assert len(s) == n and s.stats()["evicted"] == r * n
        assert s.get(int(keys[-1]))["i"][0] == i[-1]
        assert s.index.total == 2.0 * n


@pytest.mark.parametrize("batch", [3, 40, 200])  # per-slot updates, then leaves + rebuild (1/8 of 256 slots = 32)
def test_index_matches_leaves_set_one_by_one(make_spec, make_traj, shard_factory, batch):
    assert shard_insert.REBUILD_FRACTION == 8
    spec = make_spec(4)
    s = shard_factory(spec, 600, gm.Prioritized(0.7, 0.4), max_items=256)
    rng = np.random.default_rng(2)
    for _ in range(6):
        trajs = [make_traj(int(n)) for n in rng.integers(1, 5, batch)]
        cols, lengths = pack(trajs)
        s.insert_packed(cols, lengths, rng.uniform(0, 2, batch))
        ref = PriorityIndex(256)
        ref.set(np.arange(256), s.index.leaves.copy())
        for name, x, y in zip(ref.tree._fields, ref.tree, s.index.tree):
            np.testing.assert_array_equal(x, y, err_msg=name)
        live = (s.store.status >> 14) == 1  # the alive code sits over the 14 generation bits
        assert np.all(s.index.leaves[~live] == 0)
        np.testing.assert_allclose(s.index.leaves[live], s.store.priority[live] ** 0.7)


def _bad_inputs(spec, make_traj):
    """(name, packed columns, lengths, priorities, the same batch as a list of trajectories or None)."""
    trajs = [make_traj(n) for n in (4, 16, 2)]
    cols, lengths = pack(trajs)
    pr = np.ones(3)
    drop = {k: v for k, v in cols.items() if k != "act"}
    obs_bad = [dict(t) for t in trajs]
    obs_bad[1]["obs"] = obs_bad[1]["obs"][:, :2]
    str_bad = [dict(t) for t in trajs]
    str_bad[2]["img"] = np.array(["x"] * 2)
    int_bad = [dict(t) for t in trajs]
    int_bad[0]["act"] = int_bad[0]["act"].astype(np.float32)
    return [
        ("missing column", drop, lengths, pr, [{k: v for k, v in t.items() if k != "act"} for t in trajs]),
        ("unknown column", {**cols, "zzz": cols["t"]}, lengths, pr, [{**t, "zzz": t["t"]} for t in trajs]),
        ("wrong shape", {**cols, "obs": cols["obs"][:, :2]}, lengths, pr, obs_bad),
        ("non-numeric", {**cols, "img": np.array(["x"] * 22)}, lengths, pr, str_bad),
        ("uncastable", {**cols, "act": cols["act"].astype(np.float32)}, lengths, pr, int_bad),
        ("rows differ", {**cols, "done": cols["done"][:-1]}, lengths, pr, None),
        ("sum differs", cols, np.array([4, 16, 3]), pr, None),
        ("length 0", {k: v for k, v in cols.items()}, np.array([6, 16, 0]), pr, None),
        ("negative", cols, np.array([4, 20, -2]), pr, None),
        ("too long", {k: np.concatenate([v, v[:1]]) for k, v in cols.items()}, np.array([4, 17, 2]), pr, None),
        ("float lengths", cols, np.array([4.0, 16.0, 2.0]), pr, None),
        ("2-D lengths", cols, np.array([[4, 16, 2]]), pr, None),
        ("not a mapping", list(cols.values()), lengths, pr, None),
        ("NaN priority", cols, lengths, np.array([1.0, np.nan, 1.0]), trajs),
        ("negative priority", cols, lengths, np.array([1.0, 1.0, -1.0]), trajs),
        ("priority count", cols, lengths, np.ones(2), trajs),
    ]


def test_bad_input_stores_nothing_and_errs_like_insert_many(spec, make_traj, shard_factory):
    s = shard_factory(spec, 40, gm.Prioritized(0.6, 0.4))
    s.insert_many([make_traj(16), make_traj(16)])  # full enough that a good batch would evict
    before = snapshot(s)
    for name, cols, lengths, pr, as_list in _bad_inputs(spec, make_traj):
        with pytest.raises(gm.GearError) as packed_err:
            s.insert_packed(cols, lengths, pr)
        assert isinstance(packed_err.value, (gm.InvalidTrajectoryError, gm.InvalidPriorityError)), name
        if as_list is not None:
            with pytest.raises(gm.GearError) as many_err:
                s.insert_many(as_list, pr)
            assert type(many_err.value) is type(packed_err.value), (name, many_err.value, packed_err.value)
        for x, y in zip(before, snapshot(s)):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_error_messages_name_the_fault(spec, make_traj, shard_factory):
    s = shard_factory(spec, 40, max_items=3)
    trajs = [make_traj(n) for n in (4, 16, 2)]
    cols, lengths = pack(trajs)
    cases = [
        (dict(columns={**cols, "obs": cols["obs"][:, :2]}, lengths=lengths), "column 'obs' has shape (22, 2, 2); expected (steps, *(3, 2))"),
        (dict(columns=cols, lengths=[4, 16, 3]), "lengths sum to 23 steps but the columns have 22"),
        (dict(columns=cols, lengths=[6, 16, 0]), "trajectory 2: trajectory has length 0"),
        (dict(columns=cols, lengths=[2, 20, 0]), "trajectory 1: trajectory has length 20, longer than max_length=16"),
        (dict(columns={**cols, "act": cols["act"].astype(np.float32)}, lengths=lengths),
         "column 'act' has dtype float32, which cannot be cast safely to int16"),
        (dict(columns=cols, lengths=lengths, priorities=[1, 1, -1]), "priorities[2] is -1.0"),
    ]
    for kwargs, text in cases:
        with pytest.raises(gm.GearError, match=re.escape(text)):
            s.insert_packed(**kwargs)
    four = [make_traj(2) for _ in range(4)]
    with pytest.raises(gm.InvalidTrajectoryError, match="max_items=3 trajectories: split the batch"):
        s.insert_packed(*pack(four))
    with pytest.raises(gm.InvalidTrajectoryError, match="capacity_steps=40 steps"):
        s.insert_packed(*pack([make_traj(16), make_traj(16), make_traj(16)]))
    assert len(s) == 0
    s.close()
    with pytest.raises(RuntimeError):
        s.insert_packed(cols, lengths)


def test_check_finite_refuses_nan_and_inf_in_every_insert_path(spec, make_traj, shard_factory):
    """check_finite=True: a NaN or inf step value is refused naming the column and the step, and nothing is
    stored (insert, insert_many, insert_packed); by default (off, as in numpy) such values are stored."""
    s = shard_factory(spec, 40, gm.Prioritized(0.6, 0.4))
    s.insert_many([make_traj(16), make_traj(16)])  # full enough that a good batch would evict
    before = snapshot(s)
    trajs = [make_traj(n) for n in (4, 5, 3)]
    trajs[1]["obs"][3, 1, 0] = np.nan
    trajs[2]["obs"][0, 0, 1] = np.inf  # a later trajectory: the first bad one is named
    cols, lengths = pack(trajs)
    cases = [
        (lambda: s.insert(trajs[1], check_finite=True), "trajectory: column 'obs' holds nan at step 3"),
        (lambda: s.insert_many(trajs, check_finite=True), "trajectory 1: column 'obs' holds nan at step 3"),
        (lambda: s.insert_packed(cols, lengths, check_finite=True),
         "insert_packed: column 'obs' holds nan at step 3 of trajectory 1"),
        (lambda: s.insert_packed({**cols, "obs": np.where(np.isnan(cols["obs"]), -np.inf, cols["obs"])}, lengths,
                                 check_finite=True), "column 'obs' holds -inf at step 3 of trajectory 1"),
    ]
    for call, text in cases:
        with pytest.raises(ValueError, match=re.escape(text)) as info:  # an InvalidTrajectoryError
            call()
        assert isinstance(info.value, gm.InvalidTrajectoryError)
        for x, y in zip(before, snapshot(s)):
            np.testing.assert_array_equal(x, y, err_msg=text)
    good = [make_traj(4)]
    s.insert_packed(*pack(good), check_finite=True)  # finite values pass the check
    keys = s.insert_packed(cols, lengths)  # off by default: stored as given
    assert np.isnan(s.get(int(keys[1]))["obs"][3, 1, 0]) and np.isinf(s.get(int(keys[2]))["obs"][0, 0, 1])
    s.insert(trajs[1])
    s.insert_many(trajs)


def reference_plan(table, capacity, lengths):
    """The table pass as first written (plain Python, every row rewritten, every live eviction
    returned): the model the kernel's shortcuts (reused scratch, evictions taken back at once
    left out, unchanged rows not rewritten) must match. Works on copies of the table arrays: the
    narrow rows of ``table_layout`` (free slots linked through ``start`` from ``state[FREE_HEAD]``)."""
    start, length, status, stamp, times_sampled, order, state = table
    n_slots, evicted, slots = len(order), [], []
    for steps in lengths:
        while state[ring.ORDER_COUNT] > 0:
            head = order[state[ring.ORDER_HEAD]]
            alive = int(status[head]) >> ring.ALIVE_SHIFT
            if capacity - state[ring.STEPS_USED] >= steps and state[ring.ORDER_COUNT] < n_slots \
                    and alive != ring.REMOVED:
                break
            state[ring.STEP_HEAD] = (state[ring.STEP_HEAD] + int(length[head])) % capacity
            state[ring.STEPS_USED] -= int(length[head])
            state[ring.ORDER_HEAD] = (state[ring.ORDER_HEAD] + 1) % n_slots
            state[ring.ORDER_COUNT] -= 1
            if alive == ring.LIVE:
                state[ring.LIVE_COUNT] -= 1
                state[ring.LIVE_STEPS] -= int(length[head])
                state[ring.EVICTED_TOTAL] += 1
                evicted.append(head)
            status[head] = (int(status[head]) + 1) & ring.GEN_MASK  # dead, next generation
            start[head] = state[ring.FREE_HEAD]
            state[ring.FREE_HEAD] = head
            state[ring.FREE_TOP] += 1
        if state[ring.FREE_TOP] > 0:
            state[ring.FREE_TOP] -= 1
            slot = int(state[ring.FREE_HEAD])
            state[ring.FREE_HEAD] = int(start[slot])
        else:
            slot = int(state[ring.NEXT_FRESH])
            state[ring.NEXT_FRESH] += 1
        start[slot] = (state[ring.STEP_HEAD] + state[ring.STEPS_USED]) % capacity
        length[slot], times_sampled[slot] = steps, 0
        status[slot] = (int(status[slot]) & ring.GEN_MASK) | (ring.LIVE << ring.ALIVE_SHIFT)
        state[ring.NEXT_SEQ] += 1
        order[(state[ring.ORDER_HEAD] + state[ring.ORDER_COUNT]) % n_slots] = slot
        state[ring.ORDER_COUNT] += 1
        state[ring.STEPS_USED] += steps
        state[ring.LIVE_COUNT] += 1
        state[ring.LIVE_STEPS] += steps
        slots.append(slot)
    state[ring.INSERTED_TOTAL] += len(lengths)
    return np.array(slots, np.int64), np.array(evicted, np.int64)


def test_table_pass_matches_the_plain_model(make_spec, make_traj, shard_factory):
    """Random batches (one-step items filling the ring again and again, mixed lengths; priorities
    none, shared or drawn with repeats) between samples that remove items: after each insert the
    table (stamps aside) and the index are what the plain model and a rebuild from its leaves give."""
    spec = make_spec(4)
    s = shard_factory(spec, 120, gm.Prioritized(0.7, 0.4), max_items=48, max_times_sampled=2)
    rng = np.random.default_rng(5)
    for r in range(80):
        ref = [a.copy() for a in s.store.table]
        leaves = s.index.leaves.copy()
        k = int(rng.integers(1, 49 if r % 3 else 31))  # at most 48 slots, 120 steps
        lengths = np.ones(k, np.int64) if r % 3 else rng.integers(1, 5, k)
        kind = r % 4
        pr = None if kind == 0 else np.full(k, 1.5) if kind == 1 else rng.choice([0.0, 0.5, 2.0], k)
        cols, lengths = pack([make_traj(int(n)) for n in lengths])
        keys = s.insert_packed(cols, lengths, pr)
        slots, evicted = reference_plan(ref, s.store.capacity, lengths)
        for name, x, y in zip(s.store.table._fields, ref, s.store.table):
            if name != "stamp":
                np.testing.assert_array_equal(x, y, err_msg=f"round {r}: {name}")
        np.testing.assert_array_equal(s.store.resolve(keys)[0], slots)
        leaves[evicted[(ref[2][evicted] >> ring.ALIVE_SHIFT) == ring.DEAD]] = 0.0
        leaves[slots] = s.selector.weights(np.ones(k) if pr is None else pr)
        np.testing.assert_array_equal(s.index.leaves, leaves, err_msg=f"round {r}")
        fresh = PriorityIndex(48)
        fresh.set(np.arange(48), leaves)
        for name, x, y in zip(fresh.tree._fields, fresh.tree, s.index.tree):
            np.testing.assert_array_equal(x, y, err_msg=f"round {r}: {name}")
        if len(s):
            s.sample(8, window=1)  # uses count towards max_times_sampled=2: removals between inserts


def test_copies_in_their_own_thread_store_the_same(spec, make_traj, shard_factory, monkeypatch):
    """A large batch copies its columns in a thread beside the table pass (store_insert.OVERLAP_BYTES),
    in pieces the inserting thread helps with once the table is planned: forced on for every batch
    (pieces of a few steps), the tables, steps, index and keys are those of the plain path, through
    ring wrap-arounds and a full ring of one-step items; no thread is left; a copy's error reaches
    the caller."""
    import threading
    from gear_mpi.storage import store_insert
    rng = np.random.default_rng(11)
    monkeypatch.setattr(store_insert, "PIECE_BYTES", 40)  # copies in pieces of a few steps, taken by both threads
    a = shard_factory(spec, 120, gm.Uniform(), max_items=20)
    b = shard_factory(spec, 120, gm.Uniform(), max_items=20)
    for round_ in range(12):
        trajs = [make_traj(int(n)) for n in rng.integers(1, 17, rng.integers(1, 8))]
        cols, lengths = pack(trajs)
        monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1 << 62)
        ka = a.insert_packed(cols, lengths)
        monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 0)
        kb = b.insert_packed(cols, lengths)
        np.testing.assert_array_equal(ka, kb)
        same_state(a, b)
    assert not [t for t in threading.enumerate() if t.name == "gear_mpi_insert_copy"]
    one = gm.TrajectorySpec({"x": ((3,), np.float32)}, max_length=1)
    c, d = shard_factory(one, 64, max_items=64), shard_factory(one, 64, max_items=64)
    for r in range(3):  # each batch replaces the whole ring: every slot freed and taken back at once
        x = rng.standard_normal((64, 3)).astype(np.float32)
        monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1 << 62)
        kc = c.insert_packed({"x": x}, np.ones(64, np.int64))
        monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 0)
        np.testing.assert_array_equal(kc, d.insert_packed({"x": x}, np.ones(64, np.int64)))
        same_state(c, d)

    class Broken:  # a piece of the copies that fails, whichever thread takes it
        def __setitem__(self, where, value):
            raise MemoryError("copy failed")

    monkeypatch.setattr(gm.storage.TrajectoryStore, "_copy_pieces", lambda *args: [(Broken(), None, False)])
    with pytest.raises(MemoryError, match="copy failed"):
        d.insert_packed({"x": x}, np.ones(64, np.int64))
    assert not [t for t in threading.enumerate() if t.name == "gear_mpi_insert_copy"]


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo()], ids=repr)
def test_copy_thread_finishes_chunks_as_the_plain_path(spec, make_traj, shard_factory, sampler, monkeypatch):
    """A large batch's copy thread also writes the raw priorities, index leaves and keys of each chunk the
    table pass hands it (store_insert.ColumnCopies.hand): in chunks of 3, through evictions, both index
    paths and removals, the keys, tables, raw priorities and index are those of one plain pass; an
    error in that work reaches the caller and no thread is left."""
    import threading
    from gear_mpi.storage import store_insert
    rng = np.random.default_rng(17)
    a = shard_factory(spec, 150, sampler, max_items=40, max_times_sampled=2, seed=3)
    b = shard_factory(spec, 150, sampler, max_items=40, max_times_sampled=2, seed=3)
    for round_ in range(10):
        trajs = [make_traj(int(n)) for n in rng.integers(1, 9, rng.integers(1, 30))]
        pr = rng.uniform(0.0, 3.0, len(trajs))
        cols, lengths = pack(trajs)
        with monkeypatch.context() as m:
            m.setattr(store_insert, "OVERLAP_BYTES", 0)
            m.setattr(store_insert, "CHUNK_ITEMS", 3)
            ka = a.insert_packed(cols, lengths, None if round_ % 4 == 3 else pr)
        kb = b.insert_packed(cols, lengths, None if round_ % 4 == 3 else pr)
        np.testing.assert_array_equal(ka, kb)
        same_state(a, b)
        if isinstance(a.store.priority, np.ndarray):
            np.testing.assert_array_equal(a.store.priority, b.store.priority)
        if round_ % 3 == 2:  # removals (twice sampled) leave REMOVED entries in the order ring
            for _ in range(2):
                np.testing.assert_array_equal(a.sample(8, 1).keys.numpy(), b.sample(8, 1).keys.numpy())

    def broken(*args):
        raise ValueError("finish failed")

    monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 0)
    monkeypatch.setattr(gm.keys, "encode_slots", broken)  # the keys of a chunk, in the copy thread
    with pytest.raises(ValueError, match="finish failed"):
        a.insert_packed(cols, lengths, pr)
    assert not [t for t in threading.enumerate() if t.name == "gear_mpi_insert_copy"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1e-300, -2.0])
def test_the_priority_check_finds_the_first_bad_value_in_any_block(bad):
    """shard_insert._first_bad_priority tests blocks of _CHECK_BLOCK values without a branch, then scans a block that
    fails: the first bad index wherever it lies (block edges, the end), -0.0 and 0 accepted; an insert of such
    priorities refused naming the value, nothing stored."""
    from gear_mpi.storage import shard_insert
    block = shard_insert._CHECK_BLOCK
    n = 3 * block + 5
    good = np.random.default_rng(0).random(n)
    good[[3, block + 1]] = 0.0, -0.0
    assert shard_insert._first_bad_priority(good) == -1
    for at in (0, 1, block - 1, block, block + 1, 2 * block + 7, n - 1):
        p = good.copy()
        p[at] = bad
        p[min(n - 1, at + 3)] = bad  # a later bad value in the same block does not win
        assert shard_insert._first_bad_priority(p) == at
    shard = gm.Shard(gm.TrajectorySpec({"x": ((), "float32")}, max_length=1), n, gm.Prioritized(0.6, 0.4))
    p = good.copy()
    p[block + 1] = bad
    with pytest.raises(gm.InvalidPriorityError, match="priorit"):
        shard.insert_packed({"x": np.zeros(n, np.float32)}, np.ones(n, np.int64), p)
    assert len(shard) == 0

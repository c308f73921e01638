"""``Shard.append_step``'s own path (gear_mpi.storage.step_append, issue 34): what it stores is what
``insert_packed`` of the same one-step item stores -- table, columns, index levels, raw priorities, keys,
counters -- on shards large enough that the general path updates the index slot by slot, with longer
trajectories evicted by single steps, for every kind of selector; the stores it does not cover (compressed
columns) take the general path; a step that cannot be stored changes nothing.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "action": ((1,), "int64"), "reward": ((), "float32")},
                         max_length=4)


def step(i: int) -> dict:
    return {"obs": np.full(3, i, np.float32), "action": np.array([i % 5]), "reward": np.float32(i / 4)}


def exact_step(i: int) -> dict:
    """``step(i)`` as arrays of the columns' dtypes and step shapes: the appender's quick check."""
    return {"obs": np.full(3, i, np.float32), "action": np.array([i % 5]), "reward": np.array(i / 4, np.float32)}


def snapshot(shard: gm.Shard) -> dict[str, np.ndarray]:
    out = {f"table.{k}": np.array(v) for k, v in zip(shard.store.table._fields, shard.store.table) if k != "stamp"}
    out.update({f"col.{k}": v.copy() for k, v in shard.store.columns.items()})
    if shard.index is not None:
        out.update({f"index.{k}": np.array(v) for k, v in zip(shard.index.tree._fields, shard.index.tree)})
    prio = shard.store.layout.priority
    if isinstance(prio, np.ndarray):
        out["priority"] = prio.copy()
    return out


def twins(sampler, spec=SPEC, capacity=600, max_items=200):
    a, b = (gm.Shard(spec, capacity, sampler, max_items=max_items, max_times_sampled=2, seed=0, tag=7)
            for _ in range(2))
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, spec.max_length + 1, 150)
    cols = {"obs": rng.standard_normal((lengths.sum(), 3)).astype(np.float32),
            "action": rng.integers(0, 5, (lengths.sum(), 1)), "reward": rng.random(lengths.sum()).astype(np.float32)}
    prio = rng.random(150) + 0.5 if sampler.proportional else None
    for s in (a, b):  # mixed lengths: single steps evict longer trajectories, and slots and steps both run out
        s.insert_packed(cols, lengths, prio)
        for _ in range(3):  # items sampled twice are removed: released when they reach the head
            s.sample(40, 1)
    return a, b


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Prioritized(0.5, 0.4), gm.Fifo(),
                                     gm.MaxPriority()],
                         ids=lambda s: type(s).__name__ + str(getattr(s, "alpha", "")))
@pytest.mark.parametrize("priorities", ["default", "varied"])
def test_append_step_stores_what_insert_packed_stores(sampler, priorities):
    """Array for array what insert_packed stores, float priorities included (their weight is computed in
    place_one: alpha 0.6 through pow, 0.5 through the square root shortcut; -0.0 stored as +0.0)."""
    a, b = twins(sampler)
    rng = np.random.default_rng(5)
    for i in range(700):  # wraps the ring and the slots more than once
        p = 1.0 if priorities == "default" or i % 4 == 0 else float(rng.choice([0.0, -0.0, 0.25, 3.0, rng.random()]))
        one = {k: np.asarray(v)[None] for k, v in step(i).items()}
        ka = a.append_step((exact_step(i), step(i), one)[i % 3], priority=p)  # quick check, general, leading 1
        kb = int(b.insert_packed(one, np.ones(1, np.int64), np.array([p]))[0])
        assert ka == kb
        if i % 97 == 0 or i > 690:
            sa, sb = snapshot(a), snapshot(b)
            assert sa.keys() == sb.keys()
            for name in sa:
                np.testing.assert_array_equal(sa[name], sb[name], err_msg=f"step {i}: {name}")
    assert len(a) == len(b) and a.store.ring_touched == b.store.ring_touched
    assert a.inserter.bytes_inserted == b.inserter.bytes_inserted
    for x, y in zip(a.get(ka).values(), b.get(kb).values()):
        np.testing.assert_array_equal(x, y)
    if a.index is not None:
        assert a.index.total == b.index.total
    ta = a.store.layout.stamp_log
    if ta is not None:  # one anchor per insert on both (their own times), shrunk alike when full
        tb = b.store.layout.stamp_log
        assert ta.count == tb.count and ta.count < 700
        np.testing.assert_array_equal(ta.seqs[:ta.count], tb.seqs[:tb.count])
        assert np.all(np.diff(ta.stamps[:ta.count]) >= 0)


def test_append_step_into_compressed_columns_takes_the_general_path():
    spec = gm.TrajectorySpec({"obs": ((3,), "float32", gm.Compressed(level=1, chunk=8)), "action": ((1,), "int64"),
                              "reward": ((), "float32")}, max_length=1)
    a = gm.Shard(spec, 40, gm.Prioritized(), seed=0, tag=3)
    b = gm.Shard(spec, 40, gm.Prioritized(), seed=0, tag=3)
    for i in range(90):
        ka = a.append_step(step(i), priority=1.0 + i % 3)
        kb = int(b.insert_packed({k: np.asarray(v)[None] for k, v in step(i).items()}, [1], [1.0 + i % 3])[0])
        assert ka == kb
    for x, y in zip(a.get(ka).values(), b.get(kb).values()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.get(ka)["obs"], np.full((1, 3), 89, np.float32))


@pytest.mark.parametrize("bad, match", [
    (dict(step(0), obs=np.zeros((1, 1, 3), np.float32)), "column 'obs' has shape"),
    (dict(step(0), reward=np.zeros(2, np.float32)), "column 'reward' has shape"),
    (dict(step(0), action=np.float32(1.5)), "column 'action' has dtype float32"),
    (dict(step(0), action=np.array([2**40], np.uint64)), "column 'action' has dtype uint64"),
])
def test_a_bad_step_changes_nothing_on_a_full_shard(bad, match):
    a, _ = twins(gm.Prioritized(0.6, 0.4))
    before, count, stamps = snapshot(a), len(a), a.store.layout.stamp_log.count
    with pytest.raises(gm.InvalidTrajectoryError, match=match):
        a.append_step(bad, priority=2.0)
    for priority in (-1.0, float("nan"), float("inf"), -1e-300):  # floats the fast path would power
        with pytest.raises(gm.InvalidPriorityError):
            a.append_step(step(1), priority=priority)
    after = snapshot(a)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert len(a) == count and a.store.layout.stamp_log.count == stamps


def test_the_quick_check_takes_only_what_the_general_check_passes_as_it_is():
    a, _ = twins(gm.Uniform())
    ap = a.inserter.appender
    good = exact_step(3)
    assert ap.exact(good) is not None and [x is y for x, y in zip(ap.check(good), good.values())] == [True] * 3
    count, before = len(a), snapshot(a)
    renamed = {"obs": good["obs"], "action": good["action"], "rewards": good["reward"]}  # as many, one unknown
    with pytest.raises(gm.InvalidTrajectoryError, match=r"missing column\(s\) \['reward'\]"):
        a.append_step(renamed)
    with pytest.raises(gm.InvalidTrajectoryError, match=r"unknown column\(s\) \['x'\]"):
        a.append_step(dict(good, x=good["reward"]))
    with pytest.raises(gm.InvalidTrajectoryError, match="column 'obs' has shape"):
        a.append_step(dict(good, obs=np.zeros(4, np.float32)))
    after = snapshot(a)
    assert len(a) == count and all(np.array_equal(before[k], after[k]) for k in before)
    for other in (dict(good, obs=good["obs"].astype(">f4")), dict(good, reward=3 / 4), dict(good, action=[3])):
        assert ap.exact(other) is None  # another dtype object, a float, a list: the general check converts them
        got = a.get(a.append_step(other))
        assert np.array_equal(got["obs"][0], good["obs"]) and got["action"][0, 0] == 3 and got["reward"][0] == 0.75


def test_column_names_any_string_on_the_quick_path():
    names = ("it's", 'say "x"', "back\\slash\nline")
    spec = gm.TrajectorySpec({names[0]: ((2,), "float32"), names[1]: ((), "int64"), names[2]: ((), "float32")},
                             max_length=1)
    shard = gm.Shard(spec, 16, seed=0)
    value = {names[0]: np.array([1, 2], np.float32), names[1]: np.array(7), names[2]: np.array(0.5, np.float32)}
    assert shard.inserter.appender.exact(value) is not None
    got = shard.get(shard.append_step(value))
    assert [got[n][0].tolist() for n in names] == [[1.0, 2.0], 7, 0.5]


def test_append_step_refuses_a_spec_that_needs_two_steps():
    spec = gm.TrajectorySpec({"obs": ((2,), "float32"), "next_obs": gm.NextStep("obs"), "r": ((), "float32")},
                             max_length=5)
    shard = gm.Shard(spec, 64, seed=0)
    with pytest.raises(gm.InvalidTrajectoryError, match="at least 2 steps"):
        shard.append_step({"obs": np.zeros(2, np.float32), "r": np.float32(1)})
    assert len(shard) == 0

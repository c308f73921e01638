"""Shard storage: bit-exact round trips through the step ring (wrap-around, FIFO eviction),
stale keys, refusal of bad input without side effects, window sampling, and storage overhead."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import gear_mpi as gm
from gear_mpi import keys as keyspace


# ---- helpers ------------------------------------------------------------------------------

def assert_same_bytes(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, want in expected.items():
        have = np.asarray(got[name])
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        assert have.tobytes() == want.tobytes(), f"column {name!r} differs"


class FifoModel:
    """What a FIFO-evicting ring of ``capacity`` steps and ``max_items`` slots must hold."""

    def __init__(self, capacity: int, max_items: int):
        self.capacity, self.max_items = capacity, max_items
        self.live: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.evicted: dict[int, dict] = {}
        self.used = 0

    def insert(self, key: int, traj: dict) -> None:
        n = len(traj["t"])
        while self.capacity - self.used < n or len(self.live) == self.max_items:
            old, tr = self.live.popitem(last=False)
            self.used -= len(tr["t"])
            self.evicted[old] = tr
        assert key not in self.live
        self.live[key] = traj
        self.used += n


def check_against_model(shard: gm.Shard, model: FifoModel) -> None:
    st = shard.stats()
    assert len(shard) == st["items"] == len(model.live)
    assert st["live_steps"] == st["steps_used"] == model.used
    assert st["evicted"] == len(model.evicted)
    assert st["inserted"] == len(model.live) + len(model.evicted)
    for key, traj in model.live.items():
        assert_same_bytes(shard.get(key), traj)
    for key in model.evicted:
        with pytest.raises(gm.StaleKeyError):
            shard.get(key)
    # live trajectories lie back to back in the ring, in insertion order
    if model.live:
        starts, lengths = shard.locate(list(model.live))
        np.testing.assert_array_equal(lengths, [len(t["t"]) for t in model.live.values()])
        np.testing.assert_array_equal(starts[1:], (starts[:-1] + lengths[:-1]) % shard.capacity_steps)
    if model.evicted:
        starts, lengths = shard.locate(list(model.evicted))
        assert (starts == -1).all() and (lengths == 0).all()


def check_windows(batch: gm.Batch, expected: dict[int, dict], align: str) -> None:
    """Every row is a window of the trajectory behind its key, with the right padding and mask."""
    window = batch.window
    data = batch.numpy()
    mask = batch.mask.numpy()
    for i, key in enumerate(batch.keys.numpy().tolist()):
        traj = expected[key]
        length = len(traj["t"])
        n = int(batch.lengths[i])
        assert n == min(window, length)
        pad_front = window - n if (align == "tail" and length < window) else 0
        want_mask = np.zeros(window, bool)
        want_mask[pad_front:pad_front + n] = True
        np.testing.assert_array_equal(mask[i], want_mask)
        off = int(data["t"][i, pad_front]) - int(traj["t"][0])
        if align == "head":
            assert off == 0
        elif align == "tail":
            assert off == length - n
        else:
            assert 0 <= off <= length - n
        for name, col in traj.items():
            row = data[name][i]
            assert row[pad_front:pad_front + n].tobytes() == col[off:off + n].tobytes(), name
            assert not row[:pad_front].any() and not row[pad_front + n:].any(), f"{name}: padding is not zero"


@pytest.fixture
def filled(shard_factory, spec, make_traj):
    """A prioritized shard that has wrapped its ring, with its live trajectories by key."""
    shard = shard_factory(spec, 64, gm.Prioritized(0.7, 0.5), seed=3)
    rng = np.random.default_rng(5)
    expected = {}
    for _ in range(12):
        tr = make_traj(int(rng.integers(1, 17)))
        expected[shard.insert(tr, priority=float(rng.uniform(0.1, 3)))] = tr
    live = {k: v for k, v in expected.items() if shard.locate(k)[0][0] >= 0}
    return shard, live


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_bit_for_bit_across_wrap_and_eviction(shard_factory, spec, make_traj, seed):
    capacity = 97
    shard = shard_factory(spec, capacity, gm.Uniform(), seed=seed)
    model = FifoModel(capacity, capacity)
    rng = np.random.default_rng(seed)
    wrapped_live = 0
    for step in range(40):
        if rng.random() < 0.5:
            tr = make_traj(int(rng.integers(1, 17)))
            key = shard.insert(tr, priority=1.0)
            assert isinstance(key, int)
            model.insert(key, tr)
        else:
            trs = [make_traj(int(rng.integers(1, 17))) for _ in range(int(rng.integers(1, 5)))]
            keys = shard.insert_many(trs, np.ones(len(trs)))
            assert keys.dtype == np.int64 and keys.shape == (len(trs),)
            for k, tr in zip(keys.tolist(), trs):
                model.insert(k, tr)
        check_against_model(shard, model)
        starts, lengths = shard.locate(list(model.live))
        wrapped_live += int(((starts + lengths) > capacity).sum())
    assert len(model.evicted) > 50, "the ring must have wrapped several times"
    assert wrapped_live > 0, "some live trajectory must have straddled the end of the ring"
    for align in ("head", "tail", "random"):
        for window in (1, 5, 16):
            check_windows(shard.sample(64, window=window, align=align), model.live, align)


def test_a_large_batch_round_trips(shard_factory, spec, make_traj):
    """Over 256 KiB of windows: the gather kernel's parallel path."""
    shard = shard_factory(spec, 300, seed=4)
    rng = np.random.default_rng(4)
    trs = [make_traj(int(rng.integers(1, 17))) for _ in range(60)]
    keys = shard.insert_many(trs[:20]).tolist() + [shard.insert(t) for t in trs[20:]]
    live = {k: t for k, t in zip(keys, trs) if shard.locate(k)[0][0] >= 0}
    assert 10 < len(live) < 60
    for align in ("random", "tail"):
        b = shard.sample(1000, window=16, align=align)
        assert b.numpy()["obs"].nbytes + b.numpy()["t"].nbytes > 1 << 18
        check_windows(b, live, align)


def test_a_trajectory_straddling_the_ring_end_round_trips(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 20, seed=0)
    a, b = make_traj(12), make_traj(13)
    ka = shard.insert(a)
    kb = shard.insert(b)  # needs 13 steps: evicts a, starts at step 12 and wraps to step 5
    start, length = shard.locate(kb)
    assert start[0] == 12 and length[0] == 13
    assert_same_bytes(shard.get(kb), b)
    with pytest.raises(gm.StaleKeyError):
        shard.get(ka)
    for align in ("head", "tail", "random"):
        check_windows(shard.sample(8, window=16, align=align), {kb: b}, align)
        check_windows(shard.sample(8, window=13, align=align), {kb: b}, align)
        check_windows(shard.sample(32, window=4, align=align), {kb: b}, align)


def test_insert_converts_dtypes_and_stores_the_converted_values(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 50)
    tr = make_traj(6)
    loose = dict(tr, obs=tr["obs"].astype(np.float64), act=tr["act"].astype(np.int8),
                 t=torch.from_numpy(tr["t"]))
    key = shard.insert(loose)
    want = dict(tr, act=tr["act"].astype(np.int8).astype(np.int16))
    assert_same_bytes(shard.get(key), want)


def test_get_returns_a_copy(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 50)
    tr = make_traj(5)
    key = shard.insert(tr)
    got = shard.get(key)
    got["obs"][:] = 0
    assert_same_bytes(shard.get(key), tr)


def test_full_table_evicts_the_oldest(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, max_items=3)
    model = FifoModel(1000, 3)
    for n in (2, 3, 4, 5, 6, 7):
        tr = make_traj(n)
        model.insert(shard.insert(tr), tr)
        check_against_model(shard, model)
    assert len(shard) == 3 and shard.stats()["evicted"] == 3


def test_insert_many_evicts_in_order_and_keeps_the_whole_batch(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 40)
    model = FifoModel(40, 40)
    for n in (10, 10, 10):
        tr = make_traj(n)
        model.insert(shard.insert(tr), tr)
    batch = [make_traj(16), make_traj(16), make_traj(8)]  # exactly the capacity: everything older goes
    for k, tr in zip(shard.insert_many(batch, [1, 2, 3]).tolist(), batch):
        model.insert(k, tr)
    check_against_model(shard, model)
    assert len(shard) == 3 and shard.stats()["steps_used"] == 40
    np.testing.assert_array_equal(shard.priorities(list(model.live)), [1, 2, 3])


def test_insert_many_of_nothing(shard_factory, spec):
    shard = shard_factory(spec, 40)
    keys = shard.insert_many([])
    assert keys.shape == (0,) and keys.dtype == np.int64 and len(shard) == 0


def test_keys_carry_tag_rank_and_slot(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 40, rank=5, tag=200)
    keys = shard.insert_many([make_traj(3), make_traj(4)])
    tag, rank, gen, slot = keyspace.decode(keys)
    assert (tag == 200).all() and (rank == 5).all()
    assert len(set(slot.tolist())) == 2
    assert shard.rank == 5 and shard.tag == 200


# ---- stale keys -------------------------------------------------------------------------------

def test_stale_keys_never_touch_the_new_occupant(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, gm.Prioritized(1.0, 1.0), max_items=2)
    a, b, c = make_traj(4), make_traj(5), make_traj(6)
    ka = shard.insert(a, 1.0)
    kb = shard.insert(b, 2.0)
    kc = shard.insert(c, 3.0)  # the table is full: a is evicted and c takes its slot
    assert keyspace.decode(np.array([kc]))[3][0] == keyspace.decode(np.array([ka]))[3][0]
    assert kc != ka
    with pytest.raises(gm.StaleKeyError, match=f"^key {ka}") as info:  # the message as written, not quoted
        shard.get(ka)
    assert isinstance(info.value, KeyError) and not str(info.value).startswith("'")
    total = shard.total_weight
    assert shard.update_priorities([ka], [100.0]) == 0
    assert shard.stats()["stale_updates"] == 1
    assert shard.priorities([kc])[0] == 3.0
    assert shard.total_weight == total == 5.0
    assert np.isnan(shard.priorities([ka])[0])
    assert_same_bytes(shard.get(kc), c)
    # a mix of stale and live keys: the live ones are applied, the stale ones counted
    assert shard.update_priorities([ka, kb, ka], [7.0, 4.0, 9.0]) == 1
    assert shard.stats()["stale_updates"] == 3
    np.testing.assert_array_equal(shard.priorities([kb, kc]), [4.0, 3.0])
    assert shard.total_weight == 7.0
    # the stale key is never sampled: every sample comes from b or c
    batch = shard.sample(200, window=2)
    assert set(batch.keys.tolist()) == {kb, kc}


def test_update_priorities_duplicates_last_wins(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 100, gm.Prioritized(1.0, 0.0))
    k1, k2 = shard.insert_many([make_traj(3), make_traj(3)], [1.0, 1.0])
    assert shard.update_priorities(torch.tensor([k1, k2, k1]), torch.tensor([5.0, 2.0, 0.5])) == 3
    np.testing.assert_array_equal(shard.priorities([k1, k2]), [0.5, 2.0])
    assert shard.total_weight == 2.5


# ---- bad input: a clear error and no change at all ------------------------------------------

def snapshot(shard: gm.Shard, keys) -> dict:
    keys = list(keys)
    snap = {"stats": shard.stats(), "len": len(shard), "priorities": shard.priorities(keys).tolist(),
            "data": [shard.get(k) for k in keys], "locate": [a.tolist() for a in shard.locate(keys)],
            "rng": shard.rng.bit_generator.state, "state": shard.store.state.copy(),
            "ring": {n: c.copy() for n, c in shard.store.columns.items()}}
    if shard.index is not None:
        snap["leaves"] = shard.index.leaves.copy()
    return snap


def assert_unchanged(before: dict, after: dict) -> None:
    assert after["stats"] == before["stats"]
    assert after["len"] == before["len"]
    assert after["priorities"] == before["priorities"]
    assert after["locate"] == before["locate"]
    assert after["rng"] == before["rng"]
    np.testing.assert_array_equal(after["state"], before["state"])
    for got, want in zip(after["data"], before["data"]):
        assert_same_bytes(got, want)
    for name, col in before["ring"].items():
        assert after["ring"][name].tobytes() == col.tobytes(), f"ring column {name!r} was written"
    if "leaves" in before:
        assert after["leaves"].tobytes() == before["leaves"].tobytes()


def _with(tr, **changes):
    out = dict(tr)
    for k, v in changes.items():
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


BAD_INSERTS = {
    "missing column": (lambda s, mk, keys: s.insert(_with(mk(4), img=None)),
                       gm.InvalidTrajectoryError, r"missing column\(s\) \['img'\]"),
    "extra column": (lambda s, mk, keys: s.insert(_with(mk(4), reward=np.zeros(4, np.float32))),
                     gm.InvalidTrajectoryError, r"unknown column\(s\) \['reward'\]"),
    "float into int64": (lambda s, mk, keys: s.insert(_with(mk(4), t=np.arange(4.0))),
                         gm.InvalidTrajectoryError, "'t' has dtype float64, which cannot be cast safely to int64"),
    "float into int16": (lambda s, mk, keys: s.insert(_with(mk(4), act=np.zeros((4, 2), np.float32))),
                         gm.InvalidTrajectoryError, "'act' has dtype float32"),
    "per-step shape": (lambda s, mk, keys: s.insert(_with(mk(4), obs=np.zeros((4, 2, 3), np.float32))),
                       gm.InvalidTrajectoryError, r"'obs' has shape \(4, 2, 3\)"),
    "length mismatch": (lambda s, mk, keys: s.insert(_with(mk(4), done=np.zeros(3, bool))),
                        gm.InvalidTrajectoryError, "'done' has 3 steps"),
    "length 0": (lambda s, mk, keys: s.insert({k: v[:0] for k, v in mk(4).items()}),
                 gm.InvalidTrajectoryError, "length 0"),
    "too long": (lambda s, mk, keys: s.insert(mk(17)),
                 gm.InvalidTrajectoryError, "length 17, longer than max_length=16"),
    "NaN priority": (lambda s, mk, keys: s.insert(mk(4), priority=float("nan")),
                     gm.InvalidPriorityError, "must be finite"),
    "inf priority": (lambda s, mk, keys: s.insert(mk(4), priority=float("inf")),
                     gm.InvalidPriorityError, "must be finite"),
    "negative priority": (lambda s, mk, keys: s.insert(mk(4), priority=-1.0),
                          gm.InvalidPriorityError, "must be non-negative"),
    "many: wrong number of priorities": (lambda s, mk, keys: s.insert_many([mk(3), mk(3)], [1.0, 2.0, 3.0]),
                                         gm.InvalidPriorityError, "got 3 values for 2 items"),
    "many: one NaN priority": (lambda s, mk, keys: s.insert_many([mk(3), mk(3)], [1.0, np.nan]),
                               gm.InvalidPriorityError, r"priorities\[1\] is nan"),
    "many: one bad trajectory in the middle": (
        lambda s, mk, keys: s.insert_many([mk(3), _with(mk(3), t=np.arange(3.0)), mk(3)]),
        gm.InvalidTrajectoryError, "trajectory 1: column 't'"),
    "many: the last one too long": (lambda s, mk, keys: s.insert_many([mk(5), mk(5), mk(17)]),
                                    gm.InvalidTrajectoryError, "trajectory 2: trajectory has length 17"),
    "many: over capacity": (lambda s, mk, keys: s.insert_many([mk(16)] * 4 + [mk(1)]),
                            gm.InvalidTrajectoryError, "hold 65 steps, more than capacity_steps=64"),
    "many: a mapping": (lambda s, mk, keys: s.insert_many(mk(3)),
                        gm.InvalidTrajectoryError, "use insert"),
    "update: NaN": (lambda s, mk, keys: s.update_priorities(keys[:2], [1.0, np.nan]),
                    gm.InvalidPriorityError, "must be finite"),
    "update: negative": (lambda s, mk, keys: s.update_priorities(keys[:2], [-1.0, 1.0]),
                         gm.InvalidPriorityError, "non-negative"),
    "update: wrong count": (lambda s, mk, keys: s.update_priorities(keys[:3], [1.0, 2.0]),
                            gm.InvalidPriorityError, "got 2 values for 3 items"),
    "update: another replay's key": (
        lambda s, mk, keys: s.update_priorities([keys[0], _retag(keys[1], 8)], [5.0, 5.0]),
        gm.InvalidKeyError, "not issued by this replay"),
    "update: another shard's key": (
        lambda s, mk, keys: s.update_priorities([keys[0], _rerank(keys[1], 3)], [5.0, 5.0]),
        gm.InvalidKeyError, r"belongs to shard 3, not this shard \(0\)"),
    "update: negative key": (lambda s, mk, keys: s.update_priorities([keys[0], -5], [5.0, 5.0]),
                             gm.InvalidKeyError, "key -5"),
    "update: slot out of range": (lambda s, mk, keys: s.update_priorities([keys[0], _reslot(keys[1], 10**6)], [5.0, 5.0]),
                                  gm.InvalidKeyError, "names slot 1000000, but this shard has 64 slots"),
    "update: float keys": (lambda s, mk, keys: s.update_priorities([1.5], [5.0]), TypeError, "integers"),
    "get: another replay's key": (lambda s, mk, keys: s.get(_retag(keys[0], 9)),
                                  gm.InvalidKeyError, "not issued by this replay"),
    "get: another shard's key": (lambda s, mk, keys: s.get(_rerank(keys[0], 1)),
                                 gm.InvalidKeyError, "belongs to shard 1"),
    "get: two keys": (lambda s, mk, keys: s.get(keys[:2]), gm.InvalidKeyError, "one key"),
    "priorities: another replay's key": (lambda s, mk, keys: s.priorities([_retag(keys[0], 0)]),
                                         gm.InvalidKeyError, "not issued"),
    "locate: another shard's key": (lambda s, mk, keys: s.locate([_rerank(keys[0], 2)]),
                                    gm.InvalidKeyError, "belongs to shard 2"),
    "sample: window 0": (lambda s, mk, keys: s.sample(4, window=0), ValueError, "window must be"),
    "sample: align": (lambda s, mk, keys: s.sample(4, window=3, align="middle"), ValueError, "align must be"),
    "sample: negative batch": (lambda s, mk, keys: s.sample(-1, window=3), ValueError, "batch_size"),
    "sample: wrong out batch": (lambda s, mk, keys: s.sample(4, window=3, out=gm.Batch.empty(s.spec, 5, 3)),
                                ValueError, "out= does not fit"),
    "sample: wrong out window": (lambda s, mk, keys: s.sample(4, window=3, out=gm.Batch.empty(s.spec, 4, 4)),
                                 ValueError, "out= does not fit"),
    "sample: out of another spec": (
        lambda s, mk, keys: s.sample(4, window=3, out=gm.Batch.empty(
            gm.TrajectorySpec({"t": ((), "int32")}, max_length=16), 4, 3)),
        ValueError, "out= does not fit"),
}


def _retag(key: int, tag: int) -> int:
    _, rank, gen, slot = keyspace.decode(np.array([key]))
    return int(keyspace.encode(tag, int(rank[0]), slot, gen)[0])


def _reslot(key: int, slot: int) -> int:
    tag, rank, gen, _ = keyspace.decode(np.array([key]))
    return int(keyspace.encode(int(tag[0]), int(rank[0]), np.array([slot]), gen)[0])


def _rerank(key: int, rank: int) -> int:
    tag, _, gen, slot = keyspace.decode(np.array([key]))
    return int(keyspace.encode(int(tag[0]), rank, slot, gen)[0])


@pytest.mark.parametrize("case", list(BAD_INSERTS))
def test_bad_input_raises_and_changes_nothing(filled, make_traj, case):
    shard, live = filled
    action, error, words = BAD_INSERTS[case]
    keys = list(live)
    assert shard.tag == 7 and len(keys) >= 3
    before = snapshot(shard, keys)
    with pytest.raises(error, match=words):
        action(shard, make_traj, keys)
    assert_unchanged(before, snapshot(shard, keys))


def test_insert_many_over_max_items(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 100, max_items=3)
    keys = shard.insert_many([make_traj(2)] * 2)
    before = snapshot(shard, keys)
    with pytest.raises(gm.InvalidTrajectoryError, match="4 trajectories, more than max_items=3"):
        shard.insert_many([make_traj(2)] * 4)
    assert_unchanged(before, snapshot(shard, keys))


def test_empty_or_zero_mass_replay_cannot_sample(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 100, gm.Prioritized(0.5, 0.5))
    with pytest.raises(gm.EmptyReplayError, match="empty"):
        shard.sample(2, window=2)
    shard.insert(make_traj(3), priority=0.0)
    with pytest.raises(gm.EmptyReplayError, match="priority 0"):
        shard.sample(2, window=2)
    fifo = shard_factory(spec, 100, gm.Fifo())
    with pytest.raises(gm.EmptyReplayError):
        fifo.sample(1)


def test_bad_constructor_arguments(spec):
    with pytest.raises(ValueError, match="smaller than max_length"):
        gm.Shard(spec, 15)
    with pytest.raises(ValueError, match="capacity_steps"):
        gm.Shard(spec, 0)
    with pytest.raises(ValueError, match="max_items"):
        gm.Shard(spec, 100, max_items=0)
    with pytest.raises(ValueError, match="rank"):
        gm.Shard(spec, 100, rank=-1)
    with pytest.raises(ValueError, match="memory must be"):
        gm.Shard(spec, 100, memory="gpu-ish")
    with pytest.raises(ValueError, match="max_times_sampled"):
        gm.Shard(spec, 100, max_times_sampled=0)
    with pytest.raises(TypeError, match="sampler"):
        gm.Shard(spec, 100, "uniform")
    with pytest.raises(TypeError, match="TrajectorySpec"):
        gm.Shard({"x": ((), "float32")}, 100)


# ---- window sampling ----------------------------------------------------------------------------

def test_windows_longer_than_the_trajectory_are_padded(shard_factory, make_spec, make_traj):
    spec = make_spec(10)
    shard = shard_factory(spec, 100)
    tr = make_traj(4)
    key = shard.insert(tr)
    for align in ("random", "head"):
        b = shard.sample(3, window=7, align=align)
        np.testing.assert_array_equal(b.mask.numpy(), np.tile([1, 1, 1, 1, 0, 0, 0], (3, 1)).astype(bool))
        for name, col in tr.items():
            np.testing.assert_array_equal(b[name].numpy()[:, :4], np.broadcast_to(col, (3,) + col.shape))
            assert not b[name].numpy()[:, 4:].any()
        assert b.lengths.tolist() == [4, 4, 4] and b.keys.tolist() == [key] * 3
    b = shard.sample(2, window=7, align="tail")
    np.testing.assert_array_equal(b.mask.numpy(), np.tile([0, 0, 0, 1, 1, 1, 1], (2, 1)).astype(bool))
    for name, col in tr.items():
        np.testing.assert_array_equal(b[name].numpy()[:, 3:], np.broadcast_to(col, (2,) + col.shape))
        assert not b[name].numpy()[:, :3].any()


def test_window_none_means_max_length(shard_factory, make_spec, make_traj):
    spec = make_spec(12)
    shard = shard_factory(spec, 100)
    trs = {shard.insert(make_traj(n)): None for n in (3, 12)}
    b = shard.sample(6)
    assert b.window == 12 and b["obs"].shape == (6, 12, 3, 2) and b.mask.shape == (6, 12)
    expected = {k: shard.get(k) for k in trs}
    check_windows(b, expected, "random")


def test_head_and_tail_windows_of_a_long_trajectory(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 100)
    tr = make_traj(16)
    shard.insert(tr)
    head = shard.sample(2, window=5, align="head")
    np.testing.assert_array_equal(head["t"].numpy(), np.tile(tr["t"][:5], (2, 1)))
    tail = shard.sample(2, window=5, align="tail")
    np.testing.assert_array_equal(tail["t"].numpy(), np.tile(tr["t"][-5:], (2, 1)))
    assert tail.mask.all() and head.mask.all()


def test_batch_tensors_share_memory_with_numpy(filled):
    shard, _ = filled
    b = shard.sample(8, window=6)
    arrays = b.numpy()
    assert set(b.columns) == set(arrays) == set(shard.spec.names)
    for name in b:
        assert isinstance(b[name], torch.Tensor)
        assert b[name].shape == (8, 6) + shard.spec[name].shape
        assert np.shares_memory(b[name].numpy(), arrays[name])
    assert b["obs"].dtype == torch.float32 and b["act"].dtype == torch.int16 and b["done"].dtype == torch.bool
    arrays["obs"][0, 0, 0, 0] = 12345.0
    assert b["obs"][0, 0, 0, 0].item() == 12345.0
    for t, dtype in ((b.mask, torch.bool), (b.keys, torch.int64), (b.probabilities, torch.float64),
                     (b.weights, torch.float32), (b.lengths, torch.int64)):
        assert isinstance(t, torch.Tensor) and t.dtype == dtype
    assert len(b) == b.batch_size == 8 and "obs" in b and "nope" not in b
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]
    assert b.nbytes == 8 * 6 * shard.spec.step_bytes + 8 * 6 + 8 * (8 * 3 + 4)


@pytest.mark.parametrize("shape, dtype", [((256, 1, 4096), np.uint8), ((32, 1000, 11), np.float32), ((3, 5), np.bool_),
                                          ((0, 4), np.int64), ((7,), np.float64)])
def test_batch_buffers_are_aligned(shape, dtype):
    """Column buffers of a page or more start on a page boundary, smaller ones on a cache line (a memmove
    of page-aligned ring rows into a destination 16 bytes past a page boundary ran ~5x slower on AMD)."""
    from gear_mpi.batch import aligned_empty
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    align = 4096 if a.nbytes >= 4096 else 64
    assert a.nbytes == 0 or a.ctypes.data % align == 0
    spec = gm.TrajectorySpec({"obs": ((4096,), "uint8"), "r": ((), "float32")}, max_length=1)
    b = gm.Batch.empty(spec, 256, 1)
    assert b.numpy()["obs"].ctypes.data % 4096 == 0 and b.numpy()["r"].ctypes.data % 64 == 0
    assert torch.from_numpy(a).shape == shape  # a tensor over it, as a batch holds


def test_a_batch_stays_valid_after_later_samples(filled):
    shard, live = filled
    first = shard.sample(16, window=6, align="random")
    kept = {k: v.clone() for k, v in first.data.items()}
    kept_keys, kept_mask = first.keys.clone(), first.mask.clone()
    for _ in range(5):
        later = shard.sample(16, window=6, align="random")
        assert later is not first
        assert not any(np.shares_memory(later.numpy()[n], first.numpy()[n]) for n in first)
    for name, t in kept.items():
        assert torch.equal(first[name], t)
    assert torch.equal(first.keys, kept_keys) and torch.equal(first.mask, kept_mask)
    check_windows(first, live, "random")


def test_out_reuses_the_buffers(filled):
    shard, live = filled
    out = gm.Batch.empty(shard.spec, 10, 6)
    buffers = {n: a for n, a in out.numpy().items()}
    for align in ("random", "tail", "head"):
        got = shard.sample(10, window=6, align=align, out=out)
        assert got is out
        assert all(got.numpy()[n] is buffers[n] for n in buffers)
        check_windows(got, live, align)


def test_batch_size_zero(filled):
    shard, _ = filled
    b = shard.sample(0, window=4)
    assert b.batch_size == 0 and b["obs"].shape == (0, 4, 3, 2)
    assert shard.stats()["sampled"] == 0


def test_probabilities_and_lengths_in_the_batch(filled):
    shard, live = filled
    b = shard.sample(32, window=10)
    leaves = {k: float(shard.index.weights_of(shard.store.resolve(np.array([k]))[0])[0]) for k in live}
    assert all(w == np.float32(float(shard.priorities([k])[0]) ** 0.7) for k, w in leaves.items())
    total = sum(leaves.values())
    for key, p, n in zip(b.keys.tolist(), b.probabilities.tolist(), b.lengths.tolist()):
        assert p == pytest.approx(leaves[key] / total, rel=1e-12)
        assert n == min(10, len(live[key]["t"]))
    assert shard.stats()["sampled"] == 32


# ---- storage overhead -----------------------------------------------------------------------

@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo()])
def test_stored_bytes_within_5_percent_of_raw_bytes(shard_factory, sampler):
    spec = gm.TrajectorySpec({"obs": ((11,), "float32"), "action": ((3,), "float32"),
                              "reward": ((), "float32"), "done": ((), "bool")}, max_length=1000)
    shard = shard_factory(spec, 20_000, sampler)
    rng = np.random.default_rng(0)

    def hopper(length):
        done = np.zeros(length, bool)
        done[-1] = True
        return {"obs": rng.standard_normal((length, 11), np.float32),
                "action": rng.uniform(-1, 1, (length, 3)).astype(np.float32),
                "reward": rng.standard_normal(length, np.float32), "done": done}

    for i in range(30):  # wraps the ring and evicts; some shorter trajectories too
        shard.insert(hopper(1000 if i % 3 else int(rng.integers(100, 1000))))
    assert shard.stats()["evicted"] > 0
    raw = shard.raw_bytes()
    assert raw == shard.stats()["live_steps"] * spec.step_bytes == shard.stats()["raw_bytes"]
    assert spec.step_bytes == 61
    assert raw <= shard.stored_bytes() <= 1.05 * raw
    assert shard.stored_bytes() == shard.stats()["stored_bytes"]


def test_stats_use_the_replay_schema_names(spec, make_traj):
    """Shard.stats(): its rank and the figures of gear_mpi.stats.SHARD_FIGURES (the names a replay's
    ``per_rank`` and ``total`` use); ``weight`` is the selection mass."""
    from gear_mpi import stats as stats_schema
    shard = gm.Shard(spec, 50, gm.Prioritized(1.0, 0.4), tag=1)
    shard.insert(make_traj(3), priority=2.0)
    shard.insert(make_traj(4), priority=0.5)
    st = shard.stats()
    assert list(st) == ["rank"] + list(stats_schema.SHARD_FIGURES)
    assert st["weight"] == pytest.approx(2.5) and isinstance(st["weight"], float)
    assert st["items"] == len(shard) == 2 and st["capacity_steps"] == 50 and st["live_steps"] == 7
    assert all(isinstance(st[k], int) for k in stats_schema.SHARD_FIGURES if k != "weight")
    shard.close()


def test_close_and_context_manager(spec, make_traj):
    with gm.Shard(spec, 50, tag=1) as shard:
        shard.insert(make_traj(3))
        assert "memory=private" in repr(shard)
    assert "closed" in repr(shard)
    shard.close()  # idempotent


# ---- state export (what checkpoints save and load) ---------------------------------------------

def _concat_sections(sections) -> dict:
    out: dict = {}
    for name, arr in sections:
        out.setdefault(name, []).append(np.array(arr))
    return {name: np.concatenate(parts) for name, parts in out.items()}


def _copy_state(src: gm.Shard, dst: gm.Shard, with_levels: bool = True) -> None:
    """Move ``src``'s shard state into the new ``dst`` through the export methods only."""
    st = src.store
    dst.store.restore_table(st.state.copy(), _concat_sections(st.table_sections()))
    for c in src.spec.columns:
        saved = np.concatenate([np.array(seg) for seg in st.step_segments(c.name)]) \
            if st.steps_used else np.zeros(0, np.uint8)
        pos = 0
        for seg in dst.store.step_segments(c.name):
            seg[:] = saved[pos:pos + len(seg)]
            pos += len(seg)
        assert pos == len(saved) == st.steps_used * c.step_bytes
    hwm = int(st.state[gm.shard.ring.NEXT_FRESH])
    sections = dict(src.index.sections(hwm))
    if not with_levels:
        sections = {"leaves": sections["leaves"]}
    dst.index.restore(sections, hwm)
    dst.store.tag = st.tag
    dst.rng.bit_generator.state = src.rng.bit_generator.state


@pytest.mark.parametrize("with_levels", [True, False])
def test_table_and_index_state_round_trip(shard_factory, spec, make_traj, with_levels):
    from gear_mpi.kernels import ring
    from gear_mpi.kernels import TREE_FIELDS
    a = shard_factory(spec, 97, gm.Prioritized(0.7, 0.5), max_items=23, max_times_sampled=3, seed=5, tag=7)
    for i in range(60):  # wraps the ring, fills the table, evicts
        a.insert(make_traj(int(1 + i % 9)), priority=0.5 + i % 4)
    a.sample(40, 4)      # some reach max_times_sampled and are removed
    a.update_priorities(a.store.keys_of(a.store.live_slots()[:5]), [9.0, 0.0, 1.0, 2.0, 3.0])
    assert a.store.steps_used and a.stats()["removed"] and a.stats()["evicted"]
    names = [n for n, _ in a.store.table_sections()]
    assert names[:8] == list(ring.TABLE_ROWS) and set(names[8:-1]) == {"order"} and names[-1] == "free"
    b = shard_factory(spec, 97, gm.Prioritized(0.7, 0.5), max_items=23, max_times_sampled=3, seed=99, tag=7)
    _copy_state(a, b, with_levels)
    for name in ring.TABLE_FIELDS:
        if name == "stamp" and a.store.stamp.strides == (0,):  # no stamp row (Prioritized): its log's stamps
            np.testing.assert_array_equal(dict(b.store.table_sections())["stamp"],
                                          dict(a.store.table_sections())["stamp"])
        elif name not in ("order", "free"):  # only the live part of the order ring and free stack is state
            np.testing.assert_array_equal(getattr(b.store, name), getattr(a.store, name), err_msg=name)
    top = int(a.store.state[ring.FREE_TOP])
    np.testing.assert_array_equal(ring.free_stack(b.store.state, b.store.start)[:top],
                                  ring.free_stack(a.store.state, a.store.start)[:top])
    np.testing.assert_array_equal(b.store.live_slots(), a.store.live_slots())
    for name in TREE_FIELDS:
        np.testing.assert_array_equal(getattr(b.index, name), getattr(a.index, name), err_msg=name)
    for key in a.store.keys_of(a.store.live_slots()):
        assert_same_bytes(b.get(int(key)), a.get(int(key)))
    assert b.stats()["items"] == a.stats()["items"]
    for _ in range(3):  # the same future
        x, y = a.sample(16, 5), b.sample(16, 5)
        np.testing.assert_array_equal(x.keys.numpy(), y.keys.numpy())
        for name in spec.names:
            np.testing.assert_array_equal(x.numpy()[name], y.numpy()[name])
        k = x.keys.numpy()[:3]
        assert a.update_priorities(k, [1.0, 2.0, 3.0]) == b.update_priorities(k, [1.0, 2.0, 3.0])
        tr = make_traj(4)
        assert a.insert(tr) == b.insert(tr)


def test_restore_table_refuses_bad_sections_and_changes_nothing(shard_factory, spec, make_traj):
    a = shard_factory(spec, 50, max_items=20, tag=3)
    for i in range(8):
        a.insert(make_traj(3))
    good = _concat_sections(a.store.table_sections())
    b = shard_factory(spec, 50, max_items=20, tag=3)
    b.insert(make_traj(2))
    before = {name: np.array(getattr(b.store, name)) for name in gm.shard.ring.TABLE_FIELDS}
    # integer sections of another integer type are cast (format 2 and 3 saved int64); floats are not
    cases = {"seq": good["seq"][:-1], "alive": good["alive"].astype(np.float32), "free": None,
             "length": good["length"].astype(np.int64) + 1000,
             "order": np.concatenate([good["order"], [0]])}
    for name, bad in cases.items():
        sections = dict(good)
        if bad is None:
            del sections[name]
        else:
            sections[name] = bad
        with pytest.raises(ValueError, match=repr(name)):
            b.store.restore_table(a.store.state.copy(), sections)
        for k, arr in before.items():
            np.testing.assert_array_equal(getattr(b.store, k), arr, err_msg=k)
    with pytest.raises(ValueError, match="'state'"):
        b.store.restore_table(a.store.state[:5], good)
    with pytest.raises(ValueError, match="'leaves'"):
        b.index.restore({"leaves": np.zeros(3)}, 4)


def test_ring_segments():
    from gear_mpi.kernels import ring_segments
    assert ring_segments(8, 5, 10) == [(8, 10), (0, 3)]
    assert ring_segments(0, 10, 10) == [(0, 10)]
    assert ring_segments(4, 0, 10) == []


def test_index_kinds_and_sections():
    from gear_mpi.selection import DevicePriorityIndex, LEVEL_FIELDS, PriorityIndex
    assert PriorityIndex.KIND == "blocked" and DevicePriorityIndex.KIND == "generic"
    idx = PriorityIndex(300)
    idx.set(np.arange(10), np.arange(10, dtype=np.float64))
    sec = idx.sections(10)
    assert [n for n, _ in sec] == ["leaves", *LEVEL_FIELDS]
    np.testing.assert_array_equal(sec[0][1], np.arange(10.0))
    other = PriorityIndex(300)
    other.restore({"leaves": sec[0][1], "l0_sum": np.zeros(2)}, 10)  # levels that do not fit: rebuilt from leaves
    for name, arr in sec:
        np.testing.assert_array_equal(getattr(other, name)[:len(arr)], arr, err_msg=name)


# ---- memory="private" and the deprecated "numpy" ----------------------------------------------

def test_memory_numpy_is_a_deprecated_name_of_private(spec):
    from gear_mpi.storage import PrivateArena, make_arena
    from gear_mpi.storage import TrajectoryStore
    with pytest.warns(DeprecationWarning, match='memory="numpy" is deprecated'):
        shard = gm.Shard(spec, 20, memory="numpy")
    assert isinstance(shard.store.arena, PrivateArena) and "memory=private" in repr(shard)
    shard.close()
    with pytest.warns(DeprecationWarning, match="private"):
        store = TrajectoryStore(spec, 20, memory="numpy")
    assert store.arena.kind == "private"
    store.close()
    with pytest.warns(DeprecationWarning, match="private"):
        arena = make_arena("numpy", 128)
    assert isinstance(arena, PrivateArena)
    arena.close()
    with pytest.raises(ValueError, match="memory must be 'private' or 'shm'"):
        make_arena("heap", 128)


def test_priority_index_old_import_path_warns():
    from gear_mpi.selection import selectors
    from gear_mpi.selection import PriorityIndex
    with pytest.warns(DeprecationWarning, match="gear_mpi.selection.priority_index"):
        assert selectors.PriorityIndex is PriorityIndex
    with pytest.raises(AttributeError):
        selectors.NoSuchThing  # noqa: B018

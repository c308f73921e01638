"""Property test of Shard: random sequences of insert / insert_many / sample / update_priorities / get,
valid and invalid, on tiny shards (so evictions, removals and ring wrap-around happen all the time),
checked step by step against a pure-Python model of a shard.

The model (:class:`ShardModel`): an order list of entries (oldest first) holding key, data, priority,
times sampled and status (live, or removed by ``max_times_sampled`` but still holding its steps until
it reaches an end of the order); FIFO eviction while the ring lacks steps or the table lacks slots;
counters for inserted / evicted / removed / sampled / stale updates.

After every step: the shard's live keys, each live key's data (bit for bit) and priority, every
dead key's staleness, and the statistics equal the model's. Every invalid call must raise a gear_mpi
error (GearError subclasses), ValueError or TypeError with a message, and change nothing (statistics,
live data and priorities, and the random stream). Sampled keys must be live (and of positive weight
for proportional selectors, in the exact order for ordered ones), and every window's data must be the
matching steps of its trajectory, zero-padded as documented.

Runs derandomized (fixed seed) with bounded examples: a few tens of seconds.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import gear_mpi as gm
from gear_mpi import keys as keyspace
from gear_mpi.kernels import leaf_values

SPEC = gm.TrajectorySpec({"t": ((), "int64"), "obs": ((2,), "float32"), "u": ((), "uint8")}, max_length=5)
TAG = 7
SELECTORS = {"Uniform": gm.Uniform(), "Prioritized": gm.Prioritized(0.8, 0.5), "Fifo": gm.Fifo(),
             "Lifo": gm.Lifo(), "MaxPriority": gm.MaxPriority(), "MinPriority": gm.MinPriority()}
ALLOWED = (gm.GearError, ValueError, TypeError)
PRIORITIES = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.5, 7.0])


class Entry:
    __slots__ = ("key", "data", "priority", "times", "live")

    def __init__(self, key, data, priority):
        self.key, self.data, self.priority, self.times, self.live = key, data, priority, 0, True

    @property
    def length(self) -> int:
        return len(self.data["t"])


class ShardModel:
    def __init__(self, capacity: int, max_items: int, max_times: int):
        self.capacity, self.max_items, self.max_times = capacity, max_items, max_times
        self.order: list[Entry] = []
        self.live: dict[int, Entry] = {}
        self.dead: set[int] = set()
        self.inserted = self.evicted = self.removed = self.sampled = self.stale = 0

    @property
    def steps_used(self) -> int:
        return sum(e.length for e in self.order)

    def _pop_oldest(self) -> None:
        e = self.order.pop(0)
        if e.live:
            self.evicted += 1
            del self.live[e.key]
            self.dead.add(e.key)

    def insert(self, key: int, data: dict, priority: float) -> None:
        n = len(data["t"])
        while self.capacity - self.steps_used < n or len(self.order) == self.max_items:
            self._pop_oldest()
        while self.order and not self.order[0].live:
            self.order.pop(0)
        assert key not in self.live, "a live key was issued twice"
        self.dead.discard(key)  # a recycled slot with a wrapped generation would collide; not at these sizes
        e = Entry(key, data, priority)
        self.order.append(e)
        self.live[key] = e
        self.inserted += 1

    def after_sampling(self, keys: list[int]) -> None:
        self.sampled += len(keys)
        removed_any = False
        for k in keys:
            e = self.live.get(k)
            if e is None:
                continue
            e.times += 1
            if self.max_times and e.times >= self.max_times:
                e.live = False
                del self.live[k]
                self.dead.add(k)
                self.removed += 1
                removed_any = True
        if removed_any:
            while self.order and not self.order[0].live:
                self.order.pop(0)
            while self.order and not self.order[-1].live:
                self.order.pop()

    def live_in_order(self) -> list[Entry]:
        return [e for e in self.order if e.live]


def snapshot(shard: gm.Shard, model: ShardModel):
    keys = list(model.live)
    data = {k: shard.get(k) for k in keys}
    return (shard.stats(), keys, data, shard.priorities(keys).tolist() if keys else [],
            shard.rng.bit_generator.state)


def same_snapshot(a, b) -> None:
    sa, ka, da, pa, ra = a
    sb, kb, db, pb, rb = b
    assert sa == sb, (sa, sb)
    assert ka == kb and pa == pb and ra == rb
    for k in ka:
        for c in SPEC.names:
            assert da[k][c].tobytes() == db[k][c].tobytes()


class ShardMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.shard = None
        self.counter = 0

    @initialize(selector=st.sampled_from(sorted(SELECTORS)), capacity=st.integers(5, 14),
                max_items=st.sampled_from([None, 2, 3, 5]), max_times=st.sampled_from([0, 0, 1, 2, 3]),
                memory=st.sampled_from(["private", "private", "shm"]), seed=st.integers(0, 3))
    def setup(self, selector, capacity, max_items, max_times, memory, seed):
        self.selector = SELECTORS[selector]
        self.shard = gm.Shard(SPEC, capacity, self.selector, max_items=max_items,
                              max_times_sampled=max_times or None, memory=memory, seed=seed, tag=TAG)
        self.model = ShardModel(capacity, capacity if max_items is None else max_items, max_times)
        self.rng = np.random.default_rng(seed)

    def teardown(self):
        if self.shard is not None:
            self.shard.close()

    # ---- data --------------------------------------------------------------------------------
    def traj(self, length: int) -> dict[str, np.ndarray]:
        t0 = (self.counter + 1) * 100
        self.counter += 1
        return {"t": np.arange(t0, t0 + length, dtype=np.int64),
                "obs": self.rng.standard_normal((length, 2)).astype(np.float32),
                "u": self.rng.integers(0, 256, length).astype(np.uint8)}

    def expect_refusal(self, call, what: str) -> None:
        before = snapshot(self.shard, self.model)
        with pytest.raises(ALLOWED) as info:
            call()
        assert str(info.value).strip("'\" "), f"{what}: {type(info.value).__name__} without a message"
        same_snapshot(before, snapshot(self.shard, self.model))

    # ---- valid operations ----------------------------------------------------------------------
    @rule(length=st.integers(1, SPEC.max_length), priority=PRIORITIES)
    def insert(self, length, priority):
        data = self.traj(length)
        key = self.shard.insert(data, priority)
        assert isinstance(key, int)
        self.model.insert(key, data, priority)

    @rule(lengths=st.lists(st.integers(1, SPEC.max_length), min_size=0, max_size=4), data=st.data())
    def insert_many(self, lengths, data):
        if sum(lengths) > self.model.capacity or len(lengths) > self.model.max_items:
            return  # invalid: covered by bad_insert_many
        prios = [data.draw(PRIORITIES) for _ in lengths]
        trajs = [self.traj(n) for n in lengths]
        keys = self.shard.insert_many(trajs, prios if lengths else None)
        assert keys.dtype == np.int64 and len(keys) == len(lengths)
        assert len(set(keys.tolist())) == len(keys)
        for k, d, p in zip(keys.tolist(), trajs, prios):
            self.model.insert(k, d, p)

    @rule(batch=st.integers(0, 6), window=st.integers(1, 7), align=st.sampled_from(["random", "head", "tail"]))
    def sample(self, batch, window, align):
        live = self.model.live_in_order()
        weights = self.weights(live)
        if batch > 0 and (not live or (self.selector.proportional and sum(weights) == 0)):
            return  # invalid: covered by bad_sample
        b = self.shard.sample(batch, window, align)
        keys = b.keys.tolist()
        assert len(keys) == batch and b["t"].shape == (batch, window)
        by_key = {e.key: (e, w) for e, w in zip(live, weights)}
        for k in keys:
            assert k in by_key, f"sampled key {k} is not live"
        if self.selector.proportional:
            total = sum(weights)
            for row, k in enumerate(keys):
                e, w = by_key[k]
                assert w > 0, "an item of weight 0 was sampled"
                assert b.probabilities[row].item() == pytest.approx(w / total, rel=1e-9)
                if self.selector.uses_importance_weights:
                    wmin = min(x for x in weights if x > 0)
                    assert b.weights[row].item() == pytest.approx((wmin / w) ** self.selector.beta, rel=1e-5)
        else:
            assert keys == self.ordered_pick(live, batch)
        for row, k in enumerate(keys):
            self.check_window(b, row, by_key[k][0], window, align)
        self.model.after_sampling(keys)

    def weights(self, live: list[Entry]) -> list[float]:
        if isinstance(self.selector, gm.Prioritized):  # as the index holds them: rounded to float32
            return leaf_values(np.array([e.priority ** self.selector.alpha for e in live], np.float64)).tolist()
        return [1.0] * len(live)

    def ordered_pick(self, live: list[Entry], batch: int) -> list[int]:
        sel = self.selector
        if isinstance(sel, gm.Fifo):
            seq = live
        elif isinstance(sel, gm.Lifo):
            seq = live[::-1]
        else:
            sign = -1 if isinstance(sel, gm.MaxPriority) else 1
            seq = [e for _, e in sorted(enumerate(live), key=lambda t: (sign * t[1].priority, t[0]))]
        seq = seq[:batch]
        return [e.key for e in (seq * (batch // max(len(seq), 1) + 1))[:batch]] if seq else []

    def check_window(self, b: gm.Batch, row: int, e: Entry, window: int, align: str) -> None:
        length = e.length
        n = min(length, window)
        assert b.lengths[row].item() == n
        pad = window - n if (align == "tail" and length < window) else 0
        got_t = b["t"].numpy()[row]
        offset = int(got_t[pad] - e.data["t"][0])
        if align == "head":
            assert offset == 0
        elif align == "tail":
            assert offset == length - n
        assert 0 <= offset <= length - n
        mask = b.mask.numpy()[row]
        assert mask.tolist() == [pad <= i < pad + n for i in range(window)]
        for c in SPEC.names:
            col = b[c].numpy()[row]
            assert col[pad:pad + n].tobytes() == e.data[c][offset:offset + n].tobytes(), c
            assert not col[:pad].any() and not col[pad + n:].any(), f"padding of {c}"

    @rule(data=st.data())
    def update_priorities(self, data):
        pool = list(self.model.live) + sorted(self.model.dead)
        if not pool:
            return
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=0, max_size=5))
        prios = [data.draw(PRIORITIES) for _ in keys]
        applied = self.shard.update_priorities(np.array(keys, np.int64), prios)
        expect = 0
        for k, p in zip(keys, prios):
            if k in self.model.live:
                self.model.live[k].priority = p
                expect += 1
            else:
                self.model.stale += 1
        assert applied == expect

    # ---- invalid operations: a clear error, and nothing changes ---------------------------------
    @rule(case=st.sampled_from(["missing", "extra", "dtype", "shape", "ragged", "empty", "too-long", "nan-priority",
                                "negative-priority", "not-a-mapping", "object"]))
    def bad_insert(self, case):
        d = self.traj(3)
        prio = 1.0
        if case == "missing":
            del d["obs"]
        elif case == "extra":
            d["extra"] = np.zeros(3)
        elif case == "dtype":
            d["u"] = np.zeros(3, np.complex64)
        elif case == "shape":
            d["obs"] = np.zeros((3, 3), np.float32)
        elif case == "ragged":
            d["u"] = np.zeros(2, np.uint8)
        elif case == "empty":
            d = {k: v[:0] for k, v in d.items()}
        elif case == "too-long":
            d = self.traj(SPEC.max_length + 1)
        elif case == "nan-priority":
            prio = float("nan")
        elif case == "negative-priority":
            prio = -0.5
        elif case == "not-a-mapping":
            d = [1, 2, 3]
        elif case == "object":
            d["t"] = np.array([object()] * 3)
        self.expect_refusal(lambda: self.shard.insert(d, prio), f"insert/{case}")

    @rule(case=st.sampled_from(["one-bad", "priorities-length", "mapping", "over-capacity", "over-max-items",
                                "bad-priority"]))
    def bad_insert_many(self, case):
        trajs = [self.traj(1), self.traj(2)]
        prios = [1.0, 2.0]
        if case == "one-bad":
            trajs[1]["obs"] = np.zeros((2, 5), np.float32)
        elif case == "priorities-length":
            prios = [1.0]
        elif case == "mapping":
            trajs = self.traj(2)
        elif case == "over-capacity":
            n = self.model.capacity // SPEC.max_length + 1
            trajs = [self.traj(SPEC.max_length) for _ in range(n)]
            prios = [1.0] * n
        elif case == "over-max-items":
            n = self.model.max_items + 1
            trajs = [self.traj(1) for _ in range(n)]
            prios = [1.0] * n
            if n > self.model.capacity:
                return  # over capacity too: either error is fine, covered above
        elif case == "bad-priority":
            prios = [1.0, float("inf")]
        self.expect_refusal(lambda: self.shard.insert_many(trajs, prios), f"insert_many/{case}")

    @rule(case=st.sampled_from(["negative-batch", "float-batch", "zero-window", "bool-window", "align", "empty",
                                "zero-mass"]))
    def bad_sample(self, case):
        args = [2, 3, "head"]
        if case == "negative-batch":
            args[0] = -1
        elif case == "float-batch":
            args[0] = 2.0
        elif case == "zero-window":
            args[1] = 0
        elif case == "bool-window":
            args[1] = True
        elif case == "align":
            args[2] = "middle"
        elif case == "empty":
            if self.model.live:
                return
        elif case == "zero-mass":
            live = self.model.live_in_order()
            if not (live and self.selector.proportional and sum(self.weights(live)) == 0):
                return
        self.expect_refusal(lambda: self.shard.sample(*args), f"sample/{case}")

    @rule(case=st.sampled_from(["foreign-tag", "other-rank", "slot-range", "negative", "float-keys", "nan",
                                "length"]))
    def bad_update(self, case):
        keys = list(self.model.live)[:2] or [int(keyspace.encode(TAG, 0, np.array([0]), np.array([0]))[0])]
        prios = [1.0] * len(keys)
        if case == "foreign-tag":
            keys = keys + [int(keyspace.encode(TAG + 1, 0, np.array([0]), np.array([0]))[0])]
            prios.append(1.0)
        elif case == "other-rank":
            keys = keys + [int(keyspace.encode(TAG, 3, np.array([0]), np.array([0]))[0])]
            prios.append(1.0)
        elif case == "slot-range":
            keys = keys + [int(keyspace.encode(TAG, 0, np.array([self.model.max_items + 2]), np.array([0]))[0])]
            prios.append(1.0)
        elif case == "negative":
            keys = keys + [-5]
            prios.append(1.0)
        elif case == "float-keys":
            keys = [float(k) + 0.5 for k in keys]
        elif case == "nan":
            prios[-1] = float("nan")
        elif case == "length":
            prios = prios + [1.0]
        self.expect_refusal(lambda: self.shard.update_priorities(keys, prios), f"update/{case}")

    @precondition(lambda self: bool(self.model.dead))
    @rule(data=st.data())
    def get_stale(self, data):
        k = data.draw(st.sampled_from(sorted(self.model.dead)))
        with pytest.raises(gm.StaleKeyError, match="evicted or removed"):
            self.shard.get(k)

    # ---- the shard equals the model --------------------------------------------------------------
    @invariant()
    def matches_model(self):
        m = self.model
        s = self.shard.stats()
        live = m.live_in_order()
        assert s["items"] == len(self.shard) == len(live)
        assert s["live_steps"] == sum(e.length for e in live)
        assert s["steps_used"] == m.steps_used <= m.capacity
        assert (s["inserted"], s["evicted"], s["removed"], s["sampled"], s["stale_updates"]) == \
            (m.inserted, m.evicted, m.removed, m.sampled, m.stale)
        if self.selector.proportional:
            assert s["weight"] == pytest.approx(sum(self.weights(live)), rel=1e-9, abs=1e-12)
        keys = [e.key for e in live]
        if keys:
            assert self.shard.priorities(keys).tolist() == [e.priority for e in live]
            starts, lengths = self.shard.locate(keys)
            assert lengths.tolist() == [e.length for e in live]
        for e in live:
            got = self.shard.get(e.key)
            for c in SPEC.names:
                assert got[c].tobytes() == e.data[c].tobytes(), c
        dead = sorted(m.dead)
        if dead:
            assert np.isnan(self.shard.priorities(dead)).all()


ShardMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, derandomize=True, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much], database=None)
TestShardProperties = ShardMachine.TestCase

"""Bad input to a Shard and a one-rank Replay: a clear error naming the problem, and nothing changed.

Cases an audit of the public API found (the rest are in tests/test_property_shard.py, tests/test_small_calls.py
and tests/mpi/test_errors.py): a batch larger than the machine's memory (was a MemoryError, in a two-rank replay a
hang), an ``out=`` that is not a Batch (was an AttributeError), complex priorities (were taken, imaginary parts
dropped), priorities given as text ("1.5": were parsed as numbers), a ragged nested list as a column (was numpy's
"inhomogeneous shape" ValueError, naming no column), and a bad constructor argument (now agreed: the same error on
every rank, see tests/mpi/test_errors.py).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "a": ((), "int64")}, max_length=5)
SELECTORS = [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo(), gm.Lifo(), gm.MaxPriority(), gm.MinPriority()]


def trajectories(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"obs": rng.standard_normal((1 + i % 5, 3)).astype(np.float32), "a": np.arange(1 + i % 5)}
            for i in range(n)]


def filled_shard(selector) -> tuple[gm.Shard, np.ndarray]:
    shard = gm.Shard(SPEC, 40, selector, seed=3, tag=5)
    return shard, shard.insert_many(trajectories(8), 0.5 + np.arange(8))


def fingerprint(shard: gm.Shard) -> list:
    """The figures, live keys and priorities, then a sample stream (which advances the shard like its twin's)."""
    out = [len(shard), shard.stats(), shard.live_keys().tolist(), shard.priorities(shard.live_keys()).tolist()]
    for _ in range(3):
        b = shard.sample(4, 3)
        out.append((b.keys.tolist(), b["obs"].numpy().tobytes(), b.weights.tolist()))
    return out


BAD_CALLS = {
    "huge batch": (lambda s, k: s.sample(10**12, 3), ValueError, "more than this machine's memory"),
    "out= not a Batch": (lambda s, k: s.sample(2, 3, out={"obs": np.zeros((2, 3, 3))}), TypeError,
                         "out= must be a Batch"),
    "complex update": (lambda s, k: s.update_priorities(k[:2], np.array([1.0, 1j])), gm.InvalidPriorityError,
                       "must be real numbers"),
    "complex insert": (lambda s, k: s.insert(trajectories(1)[0], 1 + 0j), gm.InvalidPriorityError,
                       "must be real numbers"),
    "complex insert_packed": (lambda s, k: s.insert_packed(trajectories(1)[0], [1], [2j]), gm.InvalidPriorityError,
                              "must be real numbers"),
    "text update": (lambda s, k: s.update_priorities(k[:2], ["1", "2"]), gm.InvalidPriorityError,
                    "must be numbers"),
    "text insert": (lambda s, k: s.insert(trajectories(1)[0], "1.5"), gm.InvalidPriorityError, "must be numbers"),
    "text insert_packed": (lambda s, k: s.insert_packed(trajectories(1)[0], [1], np.array(["2"])),
                           gm.InvalidPriorityError, "must be numbers"),
    "ragged insert": (lambda s, k: s.insert({"obs": [[1.0, 2.0, 3.0], [4.0]], "a": [1, 2]}),
                      gm.InvalidTrajectoryError, "column 'obs' is not an array numpy can read"),
    "ragged insert_packed": (lambda s, k: s.insert_packed({"obs": [[1.0, 2.0, 3.0], [4.0]], "a": [1, 2]}, [2]),
                             gm.InvalidTrajectoryError, "column 'obs' is not an array numpy can read"),
}


@pytest.mark.parametrize("selector", SELECTORS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_a_bad_call_raises_a_clear_error_and_changes_nothing(selector, case):
    call, cls, what = BAD_CALLS[case]
    (shard, keys), (twin, _) = filled_shard(selector), filled_shard(selector)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning: refused, not cast
        with pytest.raises(cls, match=what):
            call(shard, keys)
    assert fingerprint(shard) == fingerprint(twin)
    shard.close()
    twin.close()


def test_one_rank_replay_refuses_a_huge_batch_and_an_out_that_is_not_a_batch():
    for mode in ("decentralized", "centralized", "local"):
        with gm.Replay(SPEC, 40, gm.Prioritized(0.6, 0.4), mode=mode, seed=1, timeout=20.0) as replay:
            replay.insert_many(trajectories(8))
            prefix = "" if mode == "local" else "sample: rank 0: "  # a local replay's own mode: the shard's error
            with pytest.raises(ValueError, match=f"^{prefix}batch_size=1000000000000 windows of 3 steps"):
                replay.sample(10**12, 3)
            with pytest.raises(TypeError, match=f"^{prefix}out= must be a Batch"):
                replay.sample(2, 3, out={"obs": 1})
            assert replay.stats()["total"]["sampled"] == 0 and len(replay.sample(2, 3)) == 2


@pytest.mark.parametrize("kw,cls,what", [({"mode": "bogus"}, ValueError, "mode must be one of"),
                                          ({"timeout": -1.0}, ValueError, "timeout must be a positive number"),
                                          ({"memory": "nope"}, ValueError, "memory must be"),
                                          ({"spec": {"obs": ((3,), "float32")}}, TypeError,
                                           "spec must be a TrajectorySpec, got dict")])
def test_a_bad_constructor_argument_is_named(kw, cls, what):
    args = {"spec": SPEC, "capacity_steps": 40, "timeout": 20.0, **kw}
    with pytest.raises(cls, match=f"^Replay construction \\(arguments\\): rank 0: {what}"):
        gm.Replay(**args)


def test_append_step_names_a_ragged_column_and_stores_nothing():
    spec = gm.TrajectorySpec({"obs": ((2,), "float32"), "a": ((), "int64")}, max_length=1)
    with gm.Shard(spec, 16, gm.Prioritized(0.6, 0.4)) as shard:
        shard.append_step({"obs": [1.0, 2.0], "a": 3})
        with pytest.raises(gm.InvalidTrajectoryError, match="append_step: column 'obs' is not an array numpy can read"):
            shard.append_step({"obs": [[1.0, 2.0], [3.0]], "a": 3})
        assert len(shard) == 1 and shard.stats()["inserted"] == 1


def test_a_closed_replay_counts_nothing_and_refuses_calls():
    """``len`` of a closed replay gave the count it held before ``close``; now 0, as its shard's."""
    replay = gm.Replay(SPEC, 40, gm.Uniform(), seed=1, timeout=20.0)
    replay.insert_many(trajectories(3))
    assert len(replay) == 3
    replay.close()
    assert len(replay) == 0 and len(replay.shard) == 0 and "items_here=0" in repr(replay)
    with pytest.raises(RuntimeError, match="this Replay is closed"):
        replay.sample(1, 1)


NOT_COUNTS = [8.5, 8.0, "8", True, float("inf"), float("nan"), 2 ** 70]


@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_a_size_or_count_that_is_no_integer_is_named(value):
    """Size and count arguments went through ``int()``: 8.5 was taken as 8, "8" as 8, a True shape as 1, inf
    raised int()'s OverflowError and a column of shape (None,) int()'s TypeError. Each now raises a ValueError
    naming the argument, and makes nothing (a Replay's on every rank: tests/mpi/test_errors.py agrees them)."""
    cases = {
        "column 'x': every dimension must be a positive integer": lambda: gm.TrajectorySpec({"x": ((value,), "f4")}, 4),
        "max_length must be a positive integer": lambda: gm.TrajectorySpec({"x": ((2,), "f4")}, value),
        "max_items must be an integer in": lambda: gm.Shard(SPEC, 40, max_items=value),
        "max_times_sampled must be an integer in": lambda: gm.Shard(SPEC, 40, max_times_sampled=value),
        "capacity_steps must be a positive integer": lambda: gm.Replay(SPEC, value, timeout=20.0),
    }
    for what, make in cases.items():
        huge = value == 2 ** 70 and what.startswith("capacity_steps")  # an integer: the memory budget refuses it
        with pytest.raises(gm.MemoryBudgetError if huge else ValueError, match="need .* GB" if huge else what):
            make()
    with gm.Replay(SPEC, 40, gm.Uniform(), seed=1, timeout=20.0) as replay:
        replay.insert_many(trajectories(3))
        with pytest.raises(ValueError, match="batches: rank 0: prefetch must be an integer in"):
            replay.batches(2, 1, prefetch=value)
        with pytest.raises(ValueError, match="batches: rank 0: limit must be an integer in"):
            replay.batches(2, 1, limit=value)
        assert len(replay) == 3 and len(replay.sample(2, 1)) == 2  # the replay goes on


def test_a_shape_that_is_not_a_sequence_or_too_large_is_named():
    with pytest.raises(ValueError, match="column 'x': a shape is an integer or a sequence of them, got None"):
        gm.TrajectorySpec({"x": (None, "f4")}, 4)
    with pytest.raises(ValueError, match=r"column 'x': every dimension .* got shape \(1048576, 1048576\)"):
        gm.TrajectorySpec({"x": ((2 ** 20, 2 ** 20), "u1")}, 4)
    assert gm.TrajectorySpec({"x": ((2, np.int64(3)), "f4"), "y": ((), "f4")}, 4).step_bytes == 28


def test_mpi_writer_names_a_max_in_flight_that_is_no_integer():
    from mpi4py import MPI
    for value in (8.5, 8.0, "8", float("inf"), None, 0):
        with pytest.raises(ValueError, match=f"max_in_flight must be an integer in \\[1, .*got {value!r}"):
            gm.MpiWriter(MPI.COMM_WORLD, 0, max_in_flight=value)


def test_a_shard_names_a_rank_or_tag_that_is_no_key_field():
    """``Shard(rank=8.5)`` was taken as rank 8 and ``rank="8"`` raised a comparison's TypeError; ``tag=8.5``,
    ``"8"`` or -1 were cut to a tag by ``int()`` and the mask."""
    for kw, what in (({"rank": 8.5}, "rank must be in"), ({"rank": "8"}, "rank must be in"),
                     ({"rank": None}, "rank must be in"), ({"tag": 8.5}, r"tag must be an integer in \[0, 255\]"),
                     ({"tag": "8"}, "tag must be"), ({"tag": -1}, "tag must be"), ({"tag": 256}, "tag must be")):
        with pytest.raises(ValueError, match=what):
            gm.Shard(SPEC, 40, **kw)
    with gm.Shard(SPEC, 40, rank=np.int64(3), tag=np.uint8(255)) as shard:
        assert (shard.store.rank, shard.store.tag) == (3, 255)

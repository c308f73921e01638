"""Bad input to the model-parallel layer fails on every rank at once, and leaves the replay as it was, on 2 ranks.

- a ``timeout`` that is not a positive number given to ``parallel_groups``, ``ReplicaSampler``, the
  ``from_*`` adopters or ``init_torch_process_group`` raises the same ValueError on every rank (it used to
  time every rank out at once, or raise on one rank while the others waited); so does a rank 0 address too
  long for ``init_torch_process_group``'s broadcast (rank 0 used to raise alone);
- a rank without a replay passing a ``spec=`` that is no TrajectorySpec fails on every rank (the leader used
  to wait for it until ``timeout``);
- a closed ReplicaSampler says so (it used to return None, as a rank that receives nothing does);
- a leader's ``deliver`` of something that is no batch of the sampler's spec fails on every member (the
  members used to wait until ``timeout``, or MPI failed the broadcast while the leader returned);
- the reporter's keys that are not integers, or priorities that are not numbers, are refused on every rank
  of the replay and of the reporter's delivery group, in both shardings (float keys used to be truncated to
  int64 and applied to the wrong items; text made the others wait until ``timeout``).

Run by tests/test_parallel_mpi.py (``mpiexec -n 2``); on another number of ranks the tests skip.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, SPEC, close_replica, insert_random

two = pytest.mark.skipif(SIZE != 2, reason="the layouts tested need 2 ranks")
#: the deadline of every collective here: a rank left waiting fails the test by a timeout well within it
DEADLINE = 8.0


def raises_on_every_rank(cls, f, match: str):
    """``f()`` raises ``cls`` with ``match`` in its message on this rank, before the deadline, and so does every rank."""
    start = time.monotonic()
    with pytest.raises(cls, match=match) as info:
        f()
    assert time.monotonic() - start < DEADLINE / 2, "the others waited for the failing rank"
    assert all(COMM.allgather(True))
    return info.value


def sampler_of(sharding: str, pipeline: int = 1, keys: list | None = None):
    """Groups of 2 ranks (tensor 2, or pipeline 2), the replay of ``sharding`` with 6 + rank prioritized items a
    shard (their keys appended to ``keys``), and its ReplicaSampler."""
    groups = gm.parallel_groups(COMM, tensor=2 // pipeline, pipeline=pipeline)
    comm = groups.replay_comm(sharding)
    replay = None if comm is None else gm.Replay(SPEC, 200, gm.Prioritized(0.8, 0.4), comm=comm, seed=5,
                                                 timeout=DEADLINE)
    if replay is not None:
        (keys if keys is not None else []).extend(insert_random(replay, 6 + RANK, np.random.default_rng(RANK)))
    return groups, replay, gm.ReplicaSampler(replay, groups, spec=SPEC, timeout=DEADLINE)


@two
@pytest.mark.parametrize("timeout", [-1, 0, "5", None, float("nan")])
def test_a_bad_timeout_fails_on_every_rank(timeout):
    """Before, ``timeout=0`` timed every rank out at once (with different messages) and left the communicator
    unusable; ``"5"`` raised float()'s error; only rank 1's bad timeout left rank 0 waiting."""
    comm = COMM.Dup()
    mine = timeout if RANK == 1 else 5.0  # one rank's bad argument: the other must not wait for it
    raises_on_every_rank(ValueError, lambda: gm.parallel_groups(comm, tensor=2, timeout=mine),
                         "parallel_groups: rank 1: timeout must be a positive number")
    # checked before torch.distributed's state (not started here): on every rank, so that rank 0's is the error
    raises_on_every_rank(ValueError, lambda: gm.parallel_groups.from_process_groups(comm=comm, timeout=timeout),
                         "from_process_groups: rank 0: timeout must be a positive number")
    raises_on_every_rank(ValueError, lambda: gm.init_torch_process_group(comm, "gloo", timeout=mine),
                         "init_torch_process_group: rank 1: timeout must be a positive number")
    groups = gm.parallel_groups(comm, tensor=2, timeout=DEADLINE)  # the communicator is still usable
    replay = gm.Replay(SPEC, 100, gm.Uniform(), comm=groups.replay_comm("world"), timeout=DEADLINE)
    raises_on_every_rank(ValueError, lambda: gm.ReplicaSampler(replay, groups, timeout=mine),
                         "ReplicaSampler: rank 1: timeout must be a positive number")
    replay.close()
    groups.free()
    comm.Free()


@two
def test_rank_0s_address_too_long_to_send_fails_on_every_rank():
    """Only rank 0's ``host`` is used: before, it raised alone and the others waited in the broadcast until the
    timeout."""
    comm = COMM.Dup()
    raises_on_every_rank(ValueError, lambda: gm.init_torch_process_group(comm, "gloo", timeout=DEADLINE,
                                                                         host="h" * 300 if RANK == 0 else None),
                         r"rank 0's address \(300 characters: 'hhh.*is too long")
    assert comm.allreduce(1) == SIZE  # nothing left pending
    comm.Free()


@two
def test_a_spec_that_is_no_spec_fails_on_every_rank():
    """Rank 1 has no replay (the "replica" sharding's non-leader) and passes a string: before, it raised
    AttributeError alone while the leader waited for it until the timeout."""
    groups = gm.parallel_groups(COMM, tensor=2)
    comm = groups.replay_comm("replica")
    replay = None if comm is None else gm.Replay(SPEC, 100, gm.Uniform(), comm=comm, timeout=DEADLINE)
    raises_on_every_rank(TypeError, lambda: gm.ReplicaSampler(replay, groups, spec=None if replay is not None else "obs",
                                                              timeout=DEADLINE),
                         "ReplicaSampler: rank 1: spec must be a TrajectorySpec")
    sampler = gm.ReplicaSampler(replay, groups, spec=SPEC, timeout=DEADLINE)  # nothing was left pending
    close_replica(replay, sampler, groups)


@two
def test_a_closed_sampler_says_so():
    groups, replay, sampler = sampler_of("world")
    assert sampler.sample(3).batch_size == 3
    sampler.close()
    sampler.close()  # idempotent
    for call in (lambda: sampler.sample(3), lambda: sampler.deliver(None), lambda: sampler.update_priorities()):
        with pytest.raises(RuntimeError, match="this sampler is closed"):
            call()
    assert replay.sample(2).batch_size == 2  # the replay is the caller's, and still works
    close_replica(replay, sampler, groups)


@two
def test_a_leaders_bad_batch_fails_on_every_member():
    """Rank 0 (the leader) delivers something else than a batch of the sampler's spec: every member raises. Before,
    the member waited until the timeout (no Batch), or MPI failed its broadcast while the leader returned (a batch
    of other columns)."""
    groups, replay, sampler = sampler_of("world")
    other = gm.TrajectorySpec({"x": ((5,), "float64")}, max_length=4)
    good = replay.sample(3, 4)  # every rank samples; the leader's is delivered
    wide = gm.TrajectorySpec({"obs": ((4,), "float32"), "step": ((), "int64"), "flag": ((2,), "uint8")},
                             max_length=12)
    for bad, cls, match in (("rows", TypeError, "must be a gear_mpi Batch, got str"),
                            (gm.Batch.empty(other, 3, 2), ValueError, r"has the columns \['x'\]"),
                            (gm.Batch.empty(wide, 3, 2), ValueError, "column 'obs' is")):
        raises_on_every_rank(cls, lambda: sampler.deliver(bad if groups.is_leader else None), match)
    raises_on_every_rank(TypeError, lambda: sampler.deliver(error="no" if groups.is_leader else None),
                         "error must be an exception")
    got = sampler.deliver(good if groups.is_leader else None)  # the group still delivers
    assert np.array_equal(COMM.bcast(good.keys.numpy(), 0), got.keys.numpy())
    close_replica(replay, sampler, groups)


def priorities_of(replay, keys: list) -> np.ndarray:
    """The priorities of this rank's own ``keys`` (none without a replay), gathered from every rank, in rank order."""
    mine = np.zeros(0) if replay is None else replay.shard.priorities(np.array(keys, np.int64))
    return np.concatenate(COMM.allgather(mine))


@two
@pytest.mark.parametrize("sharding,pipeline", [("world", 1), ("replica", 2)])
def test_a_reporters_bad_update_is_refused_on_every_rank(sharding, pipeline):
    """``"world"`` (rank 0 leader and reporter) and ``"replica"`` with 2 stages (rank 0 the leader, rank 1 the
    reporter, sending its keys over the delivery group). Before: float keys were cast to int64 (the low bits of a
    key lost: another item's priority set, or a stale key); text keys or priorities raised on the reporter alone
    while the others waited until the timeout."""
    own: list = []
    groups, replay, sampler = sampler_of(sharding, pipeline, own)
    batch = sampler.sample(4)
    keys = COMM.bcast(batch.keys.numpy().copy() if groups.is_leader else None, 0)
    before = priorities_of(replay, own)
    refused = [(lambda: torch.from_numpy(keys).double(), torch.ones(4), TypeError, "keys must be integers"),
               (lambda: ["a"] * 4, np.ones(4), TypeError, "keys must be integers"),
               (lambda: keys, ["a"] * 4, gm.InvalidPriorityError, "priorities must be numbers"),
               # ragged: spec.validate_priorities lets numpy's ValueError out (as Replay.update_priorities does)
               (lambda: keys, [[1.0], [1.0, 2.0]], ValueError, "inhomogeneous|priorities must be numbers"),
               (lambda: keys, np.ones(3), gm.InvalidPriorityError, "got 3 values for 4 items")]
    for k, p, cls, match in refused:
        raises_on_every_rank(cls, lambda: sampler.update_priorities(k(), p), match)
        assert np.array_equal(priorities_of(replay, own), before)  # nothing applied
    applied = sampler.update_priorities(torch.from_numpy(keys), torch.full((4,), 7.0))  # a good one still works
    assert applied == (4 if groups.is_leader else 0)
    assert (priorities_of(replay, own) == 7.0).sum() == len(set(keys.tolist()))
    close_replica(replay, sampler, groups)

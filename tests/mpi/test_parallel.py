"""Model-parallel groups and one batch per replica (gear_mpi.distributed.parallel), on 4 ranks.

- the groups of 2 DP x 2 TP, 2 DP x 2 PP and 1 DP x 4 PP follow Megatron's order (and another
  order when asked); a world that T P does not divide, or ranks passing different sizes, fail
  on every rank;
- in both shardings ("replica": a replay over the leaders; "world": over every rank), every rank
  of one replica that needs the batch receives the same rows, each row the window its key names,
  different replicas receive different rows, middle pipeline stages receive none;
- the rows the replicas receive follow P(item) = w / sum w exactly (chi-square, fixed seeds);
- the leader's error reaches its peers; the reporter's priority updates reach the keys' owners;
  a leader's prefetched batches are delivered the same way.

Run by tests/test_parallel_mpi.py (``mpiexec -n 4 python -m pytest tests/mpi/test_parallel.py``); on
another number of ranks the 4-rank tests skip.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, SPEC, TIMEOUT, check_windows, close_replica, insert_random

four = pytest.mark.skipif(SIZE != 4, reason="the layouts tested need 4 ranks")
LAYOUTS = [(2, 1), (1, 2)]  # (tensor, pipeline): 2 DP x 2 TP and 2 DP x 2 PP
SHARDINGS = ["replica", "world"]


def build(groups: gm.ParallelGroups, sharding: str, n_items: int, seed: int = 3):
    """The replay of ``sharding`` (None on ranks without one), ``n_items + rank`` trajectories in each shard,
    and {key: (data, priority)} of every shard."""
    comm = groups.replay_comm(sharding)
    replay = None if comm is None else gm.Replay(SPEC, 2000, gm.Prioritized(0.8, 0.4), comm=comm, seed=seed,
                                                 timeout=TIMEOUT)
    mine = {} if replay is None else insert_random(replay, n_items + RANK, np.random.default_rng(50 * seed + RANK))
    ref = {}
    for part in COMM.allgather(mine):
        ref.update(part)
    return replay, ref


def rows(batch) -> tuple | None:
    """Everything a batch holds, as comparable arrays."""
    if batch is None:
        return None
    return (tuple(a.copy() for a in batch.numpy().values()), batch.mask_numpy().copy(),
            *(a.copy() for a in batch.meta_numpy()))


def same(a: tuple, b: tuple) -> bool:
    flat = lambda t: [x for part in t for x in (part if isinstance(part, tuple) else (part,))]
    return all(np.array_equal(x, y) for x, y in zip(flat(a), flat(b)))


# ---- groups ----------------------------------------------------------------------------------------

@four
@pytest.mark.parametrize("tensor,pipeline,order", [(2, 1, "tp-dp-pp"), (1, 2, "tp-dp-pp"), (1, 4, "tp-dp-pp"),
                                                   (2, 2, "tp-dp-pp"), (1, 2, "tp-pp-dp")])
def test_groups_follow_the_rank_order(tensor, pipeline, order):
    g = gm.parallel_groups(COMM, tensor=tensor, pipeline=pipeline, order=order)
    assert (g.tensor, g.pipeline, g.data) == (tensor, pipeline, 4 // (tensor * pipeline))
    T, P, D = g.tensor, g.pipeline, g.data
    want = {"tp-dp-pp": g.pipeline_rank * D * T + g.data_rank * T + g.tensor_rank,
            "tp-pp-dp": g.data_rank * P * T + g.pipeline_rank * T + g.tensor_rank}[order]
    assert want == RANK == g.world_rank(g.tensor_rank, g.pipeline_rank, g.data_rank)
    coords = COMM.allgather((g.tensor_rank, g.pipeline_rank, g.data_rank))
    for comm, axis, size in ((g.tensor_comm, 0, T), (g.pipeline_comm, 1, P), (g.data_comm, 2, D)):
        members = comm.allgather(RANK)
        assert comm.size == size and len(members) == size
        assert [coords[m][axis] for m in members] == list(range(size))  # ranked by the axis' coordinate
        for m in members:  # the other coordinates are this rank's
            assert [c for i, c in enumerate(coords[m]) if i != axis] == \
                   [c for i, c in enumerate(coords[RANK]) if i != axis]
    replica = g.replica_comm.allgather(RANK)
    assert sorted(replica) == sorted(r for r in range(4) if coords[r][2] == g.data_rank)
    assert coords[replica[0]][:2] == (0, 0)  # the leader first
    if (tensor, pipeline, order) == (1, 2, "tp-dp-pp"):  # Megatron: pipeline groups stride over D T ranks
        assert g.pipeline_comm.allgather(RANK) == [RANK % 2, RANK % 2 + 2]
    if (tensor, pipeline, order) == (1, 2, "tp-pp-dp"):  # each replica on consecutive ranks
        assert replica == [RANK - RANK % 2, RANK - RANK % 2 + 1]
    g.free()


def test_a_world_that_tensor_times_pipeline_does_not_divide_fails_everywhere():
    with pytest.raises(ValueError, match="not a multiple of tensor \\* pipeline"):
        gm.parallel_groups(COMM, tensor=SIZE + 1)
    with pytest.raises(ValueError, match="order must name"):
        gm.parallel_groups(COMM, order="tp-pp")
    with pytest.raises(ValueError, match="tensor must be an integer"):
        gm.parallel_groups(COMM, tensor=0)


@four
def test_ranks_passing_different_sizes_fail_everywhere():
    with pytest.raises(ValueError, match="rank 1 passed other"):
        gm.parallel_groups(COMM, tensor=2 if RANK == 0 else 1)


# ---- one batch per replica ----------------------------------------------------------------------------

@four
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("tensor,pipeline", LAYOUTS, ids=["2DPx2TP", "2DPx2PP"])
def test_ranks_of_a_replica_receive_the_same_batch(tensor, pipeline, sharding):
    g = gm.parallel_groups(COMM, tensor=tensor, pipeline=pipeline)
    replay, ref = build(g, sharding, 12)
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC)
    assert sampler.sharding == sharding and sampler.receives
    for step, (align, window) in enumerate((("random", 5), ("head", 12), ("tail", 4), ("random", 1))):
        batch = sampler.sample(16, window, align)
        assert batch.batch_size == 16 and batch.window == window
        check_windows(batch, ref, window, align)
        everyone = COMM.allgather((g.data_rank, rows(batch)))
        for dp in range(g.data):
            got = [r for d, r in everyone if d == dp]
            assert len(got) == tensor * pipeline
            assert all(same(got[0], r) for r in got[1:]), f"replica {dp} step {step}: ranks got different rows"
        firsts = [next(r for d, r in everyone if d == dp) for dp in range(g.data)]
        assert not np.array_equal(firsts[0][2], firsts[1][2]), "two replicas drew the same keys"
    close_replica(replay, sampler, g)


@four
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_middle_pipeline_stages_receive_nothing_unless_asked(sharding):
    g = gm.parallel_groups(COMM, pipeline=4)  # 1 DP x 4 PP
    replay, ref = build(g, sharding, 6)
    for stages, receivers in (("ends", {0, 3}), ("all", {0, 1, 2, 3})):
        sampler = gm.ReplicaSampler(replay, g, spec=SPEC, stages=stages)
        batch = sampler.sample(8, 3)
        assert (batch is not None) == (g.pipeline_rank in receivers) == sampler.receives
        got = [r for r in COMM.allgather(rows(batch)) if r is not None]
        assert len(got) == len(receivers) and all(same(got[0], r) for r in got[1:])
        sampler.close()
    close_replica(replay, sampler, g)


@four
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("tensor,pipeline", LAYOUTS, ids=["2DPx2TP", "2DPx2PP"])
def test_the_replicas_draw_the_exact_distribution(tensor, pipeline, sharding, record_property):
    from scipy.stats import chisquare
    g = gm.parallel_groups(COMM, tensor=tensor, pipeline=pipeline)
    replay, ref = build(g, sharding, 5, seed=8)
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC)
    drawn = []
    for _ in range(40):
        batch = sampler.sample(48, 1)
        if g.is_leader:
            drawn.extend(batch.meta_numpy()[0].tolist())
    parts = COMM.gather(drawn, root=0)
    close_replica(replay, sampler, g)
    if RANK == 0:
        keys = sorted(ref)
        w = np.array([ref[k][1] ** 0.8 for k in keys])
        index = {k: i for i, k in enumerate(keys)}
        counts = np.bincount([index[k] for part in parts for k in part], minlength=len(keys))
        assert counts.sum() == 40 * 48 * g.data
        p = float(chisquare(counts, w / w.sum() * counts.sum()).pvalue)
        record_property("chisquare_p", f"{p:.3g}")
        assert p > 1e-3, (sharding, tensor, pipeline, p, counts)


@four
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_leaders_error_is_raised_by_its_peers(sharding):
    g = gm.parallel_groups(COMM, tensor=2)
    replay, _ = build(g, sharding, -RANK)  # every shard empty
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC)
    with pytest.raises(gm.EmptyReplayError):
        sampler.sample(4, 2)
    close_replica(replay, sampler, g)


@four
def test_bad_construction_fails_everywhere():
    g = gm.parallel_groups(COMM, tensor=2)
    replay, _ = build(g, "replica", 1)
    with pytest.raises(ValueError, match="stages must be"):
        gm.ReplicaSampler(replay, g, spec=SPEC, stages="first")
    with pytest.raises(ValueError, match="rank 1: a rank without a replay must pass spec"):
        gm.ReplicaSampler(replay, g, spec=None if RANK == 1 else SPEC)
    with pytest.raises(ValueError, match="rank 0: a replica's leader"):
        gm.ReplicaSampler(None, g, spec=SPEC)
    if replay is not None:
        replay.close()
    g.free()


@four
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_the_reporters_priorities_reach_the_owners(sharding):
    g = gm.parallel_groups(COMM, pipeline=2)  # the reporter (last stage) is not the leader
    replay, _ = build(g, sharding, 8)
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC)
    batch = sampler.sample(10, 2)
    keys = np.unique(batch.meta_numpy()[0])
    new = 10.0 + keys % 97  # a key drawn by both replicas gets the same value from each
    applied = sampler.update_priorities(keys, new) if g.is_reporter else sampler.update_priorities()
    sent = {}
    for part in COMM.allgather(dict(zip(keys.tolist(), new.tolist())) if g.is_reporter else {}):
        sent.update(part)
    if replay is not None:
        owner = gm.keys.decode(np.array(sorted(sent), np.int64))[1]
        own = np.array(sorted(sent), np.int64)[owner == replay.rank]
        np.testing.assert_array_equal(replay.shard.priorities(own), [sent[k] for k in own.tolist()])
    sizes = COMM.allgather(len(keys) if g.is_reporter else 0)
    assert sum(COMM.allgather(applied)) == sum(sizes)  # every reporter's keys were applied by their owners
    close_replica(replay, sampler, g)


@four
def test_a_leaders_prefetched_batches_are_delivered():
    g = gm.parallel_groups(COMM, pipeline=2)
    replay, ref = build(g, "replica", 10)
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC)
    it = replay.batches(6, 3, prefetch=2, limit=4) if g.is_leader else None
    sent = []
    for step in range(4):
        batch = sampler.deliver(next(it) if it is not None else None)
        check_windows(batch, ref, 3, "random")
        got = [r for d, r in COMM.allgather((g.data_rank, rows(batch))) if d == g.data_rank]
        assert same(got[0], got[1])
        if step == 0:  # the reporter's update goes to its leader's iterator (applied before a later sample)
            keys = np.unique(batch.meta_numpy()[0])
            sent = COMM.allgather(keys if g.is_reporter else None)
            sampler.update_priorities(keys, 50.0 + keys % 7, iterator=it)
    if it is not None:
        it.close()
        keys = np.concatenate([k for k in sent if k is not None])
        owner = gm.keys.decode(keys)[1]
        own = keys[owner == replay.rank]
        np.testing.assert_array_equal(replay.shard.priorities(own), 50.0 + own % 7)
    close_replica(replay, sampler, g)


@four
def test_an_interrupted_leader_is_unusable_at_once_and_its_peers_fail_within_the_deadline():
    """KeyboardInterrupt on a replica's leader after its replay's sample and before the delivery (a Ctrl-C landing
    there): the sampler used to stay usable, its next delivery posting a broadcast that its peers' pending one
    could meet. Now its next call raises at once, naming the interrupt; the peers' delivery raises
    CollectiveTimeoutError within their deadline, and their next call raises at once too (a timed-out delivery
    group was also left usable). One replica of 4 ranks (1 DP x 4 TP): the replay is the leader's alone."""
    g = gm.parallel_groups(COMM.Dup(), tensor=4)  # left out of step: not the world's (never freed)
    replay = None
    if g.is_leader:
        replay = gm.Replay(SPEC, 2000, gm.Prioritized(0.8, 0.4), comm=g.replay_comm("replica"), timeout=2.0)
        insert_random(replay, 6, np.random.default_rng(9))
    sampler = gm.ReplicaSampler(replay, g, spec=SPEC, timeout=2.0)
    assert len(sampler.sample(3, 2)) == 3  # in step before the interrupt
    t0 = time.monotonic()
    if g.is_leader:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        sampler.deliver = interrupted  # (the sample's call of its own delivery)
        with pytest.raises(KeyboardInterrupt):
            sampler.sample(3, 2)
        del sampler.deliver
        t0 = time.monotonic()
        for call in (lambda: sampler.sample(3, 2), lambda: sampler.update_priorities([1], [1.0]), replay.stats):
            with pytest.raises(gm.CollectiveError, match="ReplicaSampler.sample: interrupted on rank 0 by "
                                                         "KeyboardInterrupt"):
                call()
    else:
        with pytest.raises(gm.CollectiveTimeoutError, match=r"ReplicaSampler.deliver \(header\)"):
            sampler.sample(3, 2)
        assert time.monotonic() - t0 < 2.0 + 3.0
        t0 = time.monotonic()
        with pytest.raises(gm.CollectiveError, match="unusable after an earlier failure"):
            sampler.sample(3, 2)
    assert time.monotonic() - t0 < 1.0
    close_replica(replay, sampler, g)
    COMM.Barrier()

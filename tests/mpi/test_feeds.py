"""Writers, actor ranks and the global rate limiter on K ranks (real processes, shared memory and MPI).

Each rank spawns ``tests/writer_actor.py`` processes (never MPI ranks) on its own
ingest point; actor ranks of the same job send over MPI with ``gm.MpiWriter``.
Run by tests/test_feeds_mpi.py on 1 and 3 ranks; by hand:
``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_feeds.py``.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi.feeds import remote

COMM = MPI.COMM_WORLD
TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from writer_actor import MAX_LENGTH, SPEC_COLUMNS, episode  # noqa: E402

SPEC = gm.TrajectorySpec({k: (s, d) for k, (s, d) in SPEC_COLUMNS.items()}, max_length=MAX_LENGTH)


def actors(address: str, seeds, *args: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(TESTS / "writer_actor.py"), address, "--seed", str(s), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in seeds]


def anyone(flag: bool, comm=COMM) -> bool:
    return bool(comm.allreduce(int(flag), op=MPI.MAX))


def wait_for_goodbyes(replay: gm.Replay, group, seconds: float = 60.0) -> None:
    """Learners: run collectives (each drains and answers the actors' BYE) until no actor is connected."""
    deadline = time.monotonic() + seconds
    while replay.stats()["total"]["writers"]:
        assert time.monotonic() < deadline, replay.stats()
        time.sleep(0.001)


def assert_nothing_unreceived(seconds: float = 0.2) -> None:
    """Every message of the actor protocol was received: none waits for this rank on COMM (MPICH's
    MPI_Finalize fails on a communicator that holds one, and the launcher then kills the job)."""
    COMM.Barrier()
    status, until = MPI.Status(), time.monotonic() + seconds
    while not (waiting := COMM.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)) and \
            time.monotonic() < until:
        time.sleep(0.001)
    assert not waiting, f"rank {COMM.rank}: a message from rank {status.Get_source()} (tag {status.Get_tag()}) " \
                        f"was never received"
    COMM.Barrier()


def check_exact(shard: gm.Shard, expected: set) -> None:
    """The shard holds exactly the episodes ``expected`` ((seed, index) pairs), byte for byte."""
    seen = set()
    for key in shard.live_keys():
        t = shard.get(int(key))
        seed, index = int(t["x"][0, 0]), int(t["x"][0, 1])
        assert (seed, index) not in seen
        seen.add((seed, index))
        cols, priority = episode(seed, index)
        for name, want in cols.items():
            np.testing.assert_array_equal(t[name], want.astype(SPEC[name].dtype))
        assert shard.priorities([key])[0] == priority
    assert seen == expected


def test_writers_feed_each_rank_through_its_collectives():
    seeds = [10 * COMM.rank + 1, 10 * COMM.rank + 2]
    with gm.Replay(SPEC, 4000, gm.Uniform(), max_items=1000, rate_limiter=gm.MinSize(1), timeout=60) as replay:
        procs = actors(replay.writer_address(), seeds, "--episodes", "30", "--staging-steps", "32")
        calls = 0
        while anyone(any(p.poll() is None for p in procs)):
            batch = replay.sample(2, window=4)  # waits for the first item; drains the writers each call
            assert batch.meta_numpy()[0].shape == (2,)
            calls += 1
        for p in procs:
            out, err = p.communicate()
            assert p.returncode == 0 and "DONE" in out, (out, err)
        replay.ingest()
        stats = replay.stats()
        assert stats["total"]["ingested"] == 60 * COMM.size
        assert stats["per_rank"]["items"] == [60] * COMM.size
        check_exact(replay.shard, {(s, i) for s in seeds for i in range(30)})
        assert calls > 0


def test_rate_limiter_bounds_hold_with_writers_at_varying_speeds():
    spi, min_size, buffer = 2.0, 10, 30.0
    lim = gm.SampleToInsertRatio(samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=buffer)
    lo, hi = lim.min_diff, lim.max_diff
    with gm.Replay(SPEC, 8000, gm.Prioritized(0.6, 0.4), max_items=2000, rate_limiter=lim,
                   rate_limit_timeout=30, timeout=60) as replay:
        procs = actors(replay.writer_address(), [10 * COMM.rank + 1], "--episodes", "60", "--staging-steps", "16")
        procs += actors(replay.writer_address(), [10 * COMM.rank + 2], "--episodes", "30", "--staging-steps", "16",
                        "--step-sleep", "0.002")
        diffs, calls, expected = [], 0, 90 * COMM.size
        while True:
            total = replay.stats()["total"]  # a collective: drains the writers within the insert budget
            diff = total["inserted"] * spi - total["sampled"]
            diffs.append(diff)
            if total["items"] >= min_size:
                assert lo <= diff <= hi, (diff, lo, hi, total)
            if total["inserted"] == expected:
                break
            if expected * spi - total["sampled"] - 3 * COMM.size < lo:
                continue  # even every insert still to come could not admit another call: let the writers finish
            replay.sample(3, window=2)  # waits (draining) while the ratio is above its band
            calls += 1
        for p in procs:
            out, err = p.communicate()
            assert p.returncode == 0, (out, err)
        assert calls >= 5 and max(diffs) <= hi
        # the ratio is held near the target: every admitted call kept diff >= lo
        assert total["sampled"] >= spi * (total["inserted"] - 15 * COMM.size) - hi - 3 * COMM.size


def test_the_rate_limiter_holds_fast_writers_back():
    """Issue 30, item 7: two actors per rank that would run flat out under SampleToInsertRatio(4, 20, 200). The
    limiter's hold keeps the episodes staged in the writers within the documented bound (each rank: its insert
    allowance + the slack + one per writer), so the newest ingested step stays young and close() has little
    to discard; stats() and log_every report the backlog and that age."""
    spi, min_size, writers, batch = 4.0, 20, 2, 4
    lim = gm.SampleToInsertRatio(spi, min_size, 200.0)
    slack = 2 * math.ceil(batch / spi)  # the default: the items of two calls, per rank
    # the allowances of the ranks sum to at most the replay's insert budget: one band in items + min_size_to_sample
    bound = (lim.max_diff - lim.min_diff) / spi + min_size + COMM.size * (slack + writers)
    lines = []
    with gm.Replay(SPEC, 40000, gm.Uniform(), max_items=5000, rate_limiter=lim, rate_limit_timeout=60,
                   timeout=60) as replay:
        seeds = [10 * COMM.rank + i for i in range(writers)]
        procs = actors(replay.writer_address(), seeds, "--episodes", "1000000000")  # flat out, but for the hold
        meter = None
        try:
            # every actor connected before the clock starts: on a loaded machine (a second test worker
            # beside this job) a spawned actor's imports alone can take seconds
            started = time.monotonic()
            while COMM.bcast(replay.stats()["total"]["writers"] < writers * COMM.size
                             and time.monotonic() - started < 120.0):
                time.sleep(0.05)
            meter = gm.log_every(replay, seconds=1.0, log=lines.append)
            t0, calls, seen = time.monotonic(), 0, []
            while COMM.bcast(time.monotonic() - t0 < 5.0):
                replay.sample(batch, window=1)
                meter.step()
                calls += 1
                if calls % 20 == 0:
                    st = replay.stats()["total"]
                    assert st["staged"] <= bound, (st["staged"], bound, time.monotonic() - t0)
                    seen.append((time.monotonic() - t0, st["staged"], st["staged_steps"], st["ingested_age"]))
                time.sleep(0.002)
            assert all(p.poll() is None for p in procs), "the actors are held, not dead"
            st = replay.stats()
            total = st["total"]
            assert max(s for _, s, _, _ in seen) <= bound, (bound, seen)
            assert max(n for _, _, n, _ in seen) <= bound * MAX_LENGTH, (bound, seen)
            late = [age for t, _, _, age in seen if t > 2.5]
            assert late and max(late) < 2.0, seen  # seconds; flat out, the age grows with the run (issue: 17.5 s)
            assert total["ingested"] >= 50, total
            diff = total["inserted"] * spi - total["sampled"]  # the limiter still holds its band
            assert lim.min_diff - batch * COMM.size <= diff <= lim.max_diff, (diff, total)
            assert (total["writers"], total["writers_draining"]) == (writers * COMM.size, 0)
            if COMM.rank == 0:
                assert any("staged" in line and "newest ingested step" in line for line in lines), lines
            assert meter.last["total"]["staged"] <= bound and meter.last["total"]["ingested_age"] < 2.0
        finally:
            if meter is not None:
                meter.close()
            for p in procs:
                p.kill()
                p.wait()
        # what close() discards: no more than the bound (the actors are gone; their staged episodes are not)
        assert replay.stats()["total"]["staged"] <= bound


def test_rate_limit_timeout_raises_on_every_rank_and_the_replay_goes_on():
    lim = gm.MinSize(3 * COMM.size)
    with gm.Replay(SPEC, 1000, rate_limiter=lim, rate_limit_timeout=0.5, timeout=30) as replay:
        t0 = time.monotonic()
        with pytest.raises(gm.RateLimitTimeoutError, match="held this sample") as info:
            replay.sample(1)
        # the longest wait of any rank counts (a rank that came late raises sooner than its own 0.5 s)
        assert 0.4 < COMM.allreduce(time.monotonic() - t0, op=MPI.MAX) < 20
        assert len(set(COMM.allgather(str(info.value)))) == 1  # the same error on every rank
        for i in range(3):
            cols, p = episode(99, i)
            replay.insert(cols, p)
        assert len(replay.sample(2, window=1)) == 2  # usable after the error


def test_a_call_larger_than_the_band_is_refused_on_every_rank():
    lim = gm.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=2.0)
    with gm.Replay(SPEC, 1000, rate_limiter=lim, timeout=30) as replay:
        with pytest.raises(ValueError, match="can never run in a band"):
            replay.sample(5)


def test_replay_refuses_a_non_limiter():
    with pytest.raises(TypeError, match="rate_limiter must be a gear_mpi rate limiter"):
        gm.Replay(SPEC, 100, rate_limiter=3)
    with pytest.raises(ValueError, match="rate_limit_timeout"):
        gm.Replay(SPEC, 100, rate_limit_timeout=0)


@pytest.mark.skipif(COMM.size < 2, reason="needs actor and learner ranks")
def test_actor_ranks_send_episodes_over_mpi():
    learners = max(1, COMM.size // 2)
    is_learner = COMM.rank < learners
    group = COMM.Split(0 if is_learner else 1, COMM.rank)
    try:
        if is_learner:
            mine = [r for r in range(learners, COMM.size) if r % learners == COMM.rank]
            with gm.Replay(SPEC, 4000, gm.Fifo(), max_items=1000, comm=group, timeout=60) as replay:
                replay.accept_remote(COMM)
                deadline = time.monotonic() + 60
                while anyone(len(replay) < 25 * len(mine), group):
                    replay.sample(0)  # a collective: drains the actors' episodes
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                check_exact(replay.shard, {(r, i) for r in mine for i in range(25)})
                assert replay.stats()["total"]["ingested"] == 25 * (COMM.size - learners)
                wait_for_goodbyes(replay, group)
            COMM.Barrier()  # the actors have closed: answered (FAREWELL) while this rank sampled
        else:
            with gm.MpiWriter(COMM, COMM.rank % learners, timeout=60, max_in_flight=4) as w:
                assert w.spec == SPEC
                for i in range(25):
                    cols, p = episode(COMM.rank, i)
                    if i % 2:
                        w.insert(cols, p)
                    else:
                        for t in range(len(cols["r"])):
                            w.append({k: v[t] for k, v in cols.items()})
                        w.end_episode(p)
                w.flush()
            assert w._answered and not w._learner_closed  # the learner answered the goodbye (FAREWELL)
            COMM.Barrier()
        assert_nothing_unreceived()
    finally:
        group.Free()


def test_an_inbox_keeps_what_a_drain_has_no_room_for():
    """A learner whose ring holds two longest episodes: a drain takes what has arrived in batches of what fits,
    keeping the next matched episode for the next batch (``RemoteInbox._held``); every episode the actors sent
    enters once, in order, and the ring ends holding the newest."""
    if COMM.size < 2:
        pytest.skip("needs an actor rank")
    learners = 1
    is_learner = COMM.rank < learners
    group = COMM.Split(0 if is_learner else 1, COMM.rank)
    sent = 12
    try:
        if is_learner:
            actors_ = list(range(learners, COMM.size))
            with gm.Replay(SPEC, 2 * MAX_LENGTH, gm.Fifo(), comm=group, timeout=60) as replay:
                replay.accept_remote(COMM)
                connected = COMM.Ibarrier()  # the actors' MpiWriter wait for this rank to answer them
                deadline, drains = time.monotonic() + 60, []
                while not connected.Test():  # (an actor may start sending before this rank sees the barrier end)
                    drains.append(replay.ingest())
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                COMM.Barrier()  # every actor has sent everything: the drains below see the rest of it waiting
                while replay.stats()["total"]["ingested"] < sent * len(actors_):  # (stats drains too)
                    drains.append(replay.ingest())
                    assert time.monotonic() < deadline, drains
                assert replay.stats()["total"]["ingested"] == sent * len(actors_)
                # the ring holds the newest episodes, whole (Fifo eviction): of each actor the last ones it sent
                held = {(int(replay.get(int(k))["x"][0, 0]), int(replay.get(int(k))["x"][0, 1]))
                        for k in replay.shard.live_keys()}
                for actor in {a for a, _ in held}:
                    got = sorted(i for a, i in held if a == actor)
                    assert got == list(range(sent - len(got), sent)), (actor, got)
                check_exact(replay.shard, held)
                assert sum(drains) <= sent * len(actors_), drains  # (the rest entered at stats' drains)
                wait_for_goodbyes(replay, group)  # the actors close: each BYE is answered here
        else:
            with gm.MpiWriter(COMM, 0, timeout=60, max_in_flight=sent) as w:
                COMM.Ibarrier().Wait()  # connected (a non-blocking barrier matches only its kind: the learner's)
                for i in range(sent):
                    cols, p = episode(COMM.rank, i)
                    w.insert(cols, p)
                COMM.Barrier()
                w.flush()
        assert_nothing_unreceived()
    finally:
        group.Free()


def test_a_malformed_message_keeps_the_episodes_received_before_it():
    """An actor's message that is not an episode (here 5 bytes, shorter than an episode's head) raises
    WriterError naming its rank; the episodes received before it in the same drain are stored (they were
    received, then dropped with it), and a message shorter than the head is that error, not numpy's."""
    if COMM.size < 2:
        pytest.skip("needs an actor rank")
    is_learner = COMM.rank == 0
    group = COMM.Split(0 if is_learner else 1, COMM.rank)
    try:
        if is_learner:
            with gm.Replay(SPEC, 4000, gm.Fifo(), max_items=1000, comm=group, timeout=60) as replay:
                replay.accept_remote(COMM)
                connected, deadline = COMM.Ibarrier(), time.monotonic() + 60
                while not connected.Test():  # answers rank 1's HELLO
                    replay.ingest()
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                COMM.Barrier()  # rank 1 sends only now: nothing of it was drained above
                COMM.Barrier()  # rank 1 has sent two episodes, then the bad message
                while True:
                    try:
                        replay.ingest()
                    except gm.WriterError as e:
                        assert "rank 1 sent a message of 5 bytes that is not an episode of this spec" in str(e)
                        break
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                assert len(replay) == 2
                check_exact(replay.shard, {(1, 0), (1, 1)})
                wait_for_goodbyes(replay, group)
        elif COMM.rank == 1:
            with gm.MpiWriter(COMM, 0, timeout=60) as w:
                COMM.Ibarrier().Wait()
                COMM.Barrier()
                for i in range(2):
                    w.insert(*episode(1, i))
                COMM.Send(np.zeros(5, np.uint8), dest=0, tag=remote.TAG_EPISODE)  # after them: MPI keeps order
                COMM.Barrier()
                w.flush()
        else:
            COMM.Ibarrier().Wait()
            COMM.Barrier()
            COMM.Barrier()
        assert_nothing_unreceived()
    finally:
        group.Free()


@pytest.mark.parametrize("first", ["actors", "learner", "connecting"])
def test_goodbyes_leave_no_message_unreceived_whoever_closes_first(first):
    """The close handshake (BYE, answered by FAREWELL or CLOSED): the actors close their writers while the learner
    no longer samples (``actors``: the learner's close answers them), the learner closes its replay while the
    actors insert (``learner``: they raise WriterError at their next call, answer with BYE, and close), or while
    their HELLO waits unanswered (``connecting``: the close answers it with the spec, then CLOSED). Either way no
    message is left unreceived on COMM, whose MPI_Finalize would fail otherwise (MPICH 5)."""
    if COMM.size < 2:
        pytest.skip("needs an actor rank")
    is_learner = COMM.rank == 0
    group = COMM.Split(0 if is_learner else 1, COMM.rank)
    actors_, first_batch = COMM.size - 1, 5
    try:
        if is_learner:
            with gm.Replay(SPEC, 4000, gm.Fifo(), max_items=1000, comm=group, timeout=30) as replay:
                replay.accept_remote(COMM)
                deadline = time.monotonic() + 30
                if first == "connecting":  # every HELLO is here, none taken: the close meets them first
                    while not all(COMM.Iprobe(source=a, tag=remote.TAG_HELLO) for a in range(1, COMM.size)):
                        assert time.monotonic() < deadline
                        time.sleep(0.001)
                else:
                    connected = COMM.Ibarrier()
                    while not connected.Test():
                        replay.ingest()
                        time.sleep(0.001)
                    # every actor sent its first batch (the total alone could be reached by a fast actor's later
                    # episodes while a slow one is still in its first batch, which the close would then cut)
                    sent = COMM.Ibarrier()
                    while not sent.Test():
                        replay.ingest()
                        time.sleep(0.001)
                    while replay.stats()["total"]["ingested"] < first_batch * actors_:
                        assert time.monotonic() < deadline
                        time.sleep(0.001)
                if first == "actors":
                    COMM.Barrier()  # the actors close now; this rank samples no more before its close
                    time.sleep(0.2)
                    assert replay.stats()["total"]["writers"] <= actors_
            if first != "actors":
                COMM.Barrier()  # the replay closed while the actors inserted or connected
        else:
            with gm.MpiWriter(COMM, 0, timeout=30, max_in_flight=4) as w:
                i = 0
                if first != "connecting":
                    COMM.Ibarrier().Wait()
                    for i in range(first_batch):
                        w.insert(*episode(COMM.rank, i))
                    i += 1
                    COMM.Ibarrier().Wait()  # the first batch is sent (the learner ingests meanwhile)
                if first == "actors":
                    COMM.Barrier()
                else:
                    with pytest.raises(gm.WriterError, match="was closed"):
                        while i < 100000:  # until the learner's CLOSED arrives (backpressure: at most 4 ahead)
                            w.insert(*episode(COMM.rank, i))
                            i += 1
                    assert w._learner_closed
            assert w._answered  # close() returned: the learner answered (FAREWELL or CLOSED)
            if first != "actors":
                COMM.Barrier()
        assert_nothing_unreceived()
    finally:
        group.Free()


def test_a_replay_larger_than_the_node_is_refused_on_every_rank():
    from gear_mpi.storage import budget
    have, where = budget.mem_available()
    if have is None:
        pytest.skip("this machine reports no available memory")
    # twice what the node can give, per rank; rank 0's figure: MemAvailable moves between the ranks' reads
    steps = COMM.bcast(int(have // SPEC.step_bytes) * 2)
    with pytest.raises(gm.MemoryBudgetError, match="need .* for their shards") as info:
        gm.Replay(SPEC, steps, timeout=30)
    assert len(set(COMM.allgather(str(info.value)))) == 1
    assert where in str(info.value)
    with gm.Replay(SPEC, 1000, timeout=30) as replay:  # a replay that fits is built as before
        st = replay.stats()["per_rank"]
        assert st["reserved_bytes"][COMM.rank] >= 1000 * SPEC.step_bytes


@pytest.mark.skipif(MPI.COMM_WORLD.size < 2, reason="needs a learner rank")
def test_an_actor_names_its_learner_by_a_whole_rank():
    """``MpiWriter(comm, 1.5)`` was read as rank 1 (and ``True`` too): now a ValueError, before any message."""
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        for bad in (1.5, True, "1"):
            with pytest.raises(ValueError, match=f"learner must be another rank of comm .*got {bad!r}"):
                gm.MpiWriter(comm, bad)
    comm.Barrier()

"""replay.batches(): batches sampled ahead on a background thread, on K ranks.

The iterator must give exactly the batches that plain samples give (same seed, same
schedule of updates as documented in gear_mpi.distributed.prefetch), stop cleanly on every path,
and keep other threads off the replay while it runs. Run by tests/test_prefetch_mpi.py.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi.keys import GEN_BITS, RANK_BITS, SLOT_BITS

COMM = MPI.COMM_WORLD
SPEC = gm.TrajectorySpec({"x": ((2,), np.float32), "r": ((), np.float32)}, max_length=8)


def build(seed: int = 5, timeout: float = 60.0, comm=None) -> gm.Replay:
    replay = gm.Replay(SPEC, 4000, gm.Prioritized(0.8, 0.4), seed=seed, timeout=timeout, comm=comm)
    rng = np.random.default_rng(100 + COMM.rank)
    for i in range(40):
        n = int(rng.integers(1, 9))
        replay.insert({"x": rng.standard_normal((n, 2)), "r": np.full(n, i, np.float32)}, float(rng.uniform(0.1, 2)))
    return replay


@pytest.mark.parametrize("recycle", [False, True, "auto"])
def test_prefetched_batches_are_the_plain_samples_with_updates_at_the_documented_point(recycle):
    prefetch, n, update_after = 2, 12, (3, 7)
    updates = {}
    untagged = (1 << (SLOT_BITS + GEN_BITS + RANK_BITS)) - 1  # the replays' random key tags differ
    with build() as replay:  # the reference: plain samples, each update applied before sample k + prefetch + 1
        plain, applied = [], 0
        for j in range(1, n + 1):
            for k in update_after:
                if j == k + prefetch + 1:
                    applied += replay.update_priorities(*updates[k])
            b = replay.sample(6, window=3)
            plain.append((b.keys.numpy().copy(), b["x"].numpy().copy()))
            if j in update_after:  # new priorities from this batch's keys (rank-dependent, deterministic)
                updates[j] = (b.keys.numpy().copy(), np.full(6, 50.0 + j + COMM.rank))
    with build() as replay:
        got, objects = [], []
        with replay.batches(6, window=3, prefetch=prefetch, limit=n, recycle=recycle) as it:
            for j, b in enumerate(it, start=1):
                got.append((b.keys.numpy().copy(), b["x"].numpy().copy()))
                objects.append(b)
                if j in update_after:  # the batch's own keys tensor (read from its buffer), or a numpy array
                    it.update_priorities(b.keys if j == update_after[0] else b.keys.numpy(), updates[j][1])
        assert len(got) == n
        ring = prefetch + 2  # recycle: batch j is refilled as batch j + prefetch + 2, not before
        reused = recycle is True  # "auto" refills none: the loop keeps every batch in `objects`
        assert all((objects[i] is objects[i + ring]) == reused for i in range(n - ring))
        assert len({id(o) for o in objects}) == (ring if reused else n)
        assert it.recycled == (n - ring if reused else 0)
        for (k1, x1), (k2, x2) in zip(plain, got):
            np.testing.assert_array_equal(k1 & untagged, k2 & untagged)
            np.testing.assert_array_equal(x1, x2)
        # the thread's updates take one allgather (counts and keys folded into the agreement, no counts back):
        # each rank counts what its own shard applied, so only the totals match the plain updates'
        assert COMM.allreduce(it.applied) == COMM.allreduce(applied) > 0
        assert replay.sample(2).keys.shape == (2,)  # the main thread has the replay back


def test_updates_of_every_size_route_as_plain_updates_do():
    """The thread's updates ride on one allgather once their size is known, else an alltoallv follows:
    updates of changing sizes (smaller, larger than the last), any rank's keys, duplicates within a rank
    (the last wins) and between ranks (the highest rank wins) give exactly the plain updates' batches."""
    prefetch, n = 1, 10
    sizes = [6, 3, 12, 12, 0, 9, 12, 5, 12, 1]  # 12: the batch's keys twice, other priorities the second time

    def update_of(j, keys):
        k = np.concatenate([keys, keys])[:sizes[j - 1]]
        return k, 1.0 + (np.arange(len(k)) % 5) + 3 * COMM.rank + j
    untagged = (1 << (SLOT_BITS + GEN_BITS + RANK_BITS)) - 1
    with build(seed=9) as replay:
        plain, pending = [], {}
        for j in range(1, n + 1):
            if j - prefetch - 1 in pending:
                replay.update_priorities(*pending.pop(j - prefetch - 1))
            b = replay.sample(6, window=3)
            plain.append(b.keys.numpy() & untagged)
            pending[j] = update_of(j, b.keys.numpy().copy())
    with build(seed=9) as replay:
        with replay.batches(6, window=3, prefetch=prefetch, limit=n) as it:
            for j, b in enumerate(it, start=1):
                np.testing.assert_array_equal(b.keys.numpy() & untagged, plain[j - 1])
                it.update_priorities(*update_of(j, b.keys.numpy().copy()))
        assert replay.fold_keys == sizes[-1]  # the last update's keys per rank: the next allgather carries as many


def test_auto_recycling_refills_only_batches_nobody_holds():
    """recycle="auto": a dropped batch is refilled; one the loop still holds through a view of a tensor,
    a tensor's numpy() or a numpy view of a buffer is left as it was, and a new batch takes its place."""
    prefetch, n = 1, 24
    ring = prefetch + 2
    holders = {1: lambda b: b["x"][:, 0], 6: lambda b: b.keys.numpy(), 11: lambda b: b.numpy()["r"][2:],
               16: lambda b: b.mask[1]}
    with build() as replay:
        refs, kept, same = [], {}, []
        with replay.batches(6, window=3, prefetch=prefetch, limit=n) as it:
            for j, b in enumerate(it):
                refs.append(weakref.ref(b))
                if j >= ring:  # is this batch j - ring's object, refilled?
                    same.append(refs[j - ring]() is b)
                if j in holders:  # keep a torch view, a tensor's numpy(), a buffer's numpy view
                    hold = holders[j](b)
                    kept[j] = (hold, hold.clone() if hasattr(hold, "clone") else hold.copy())
        recycled = it.recycled
    for j, (hold, copy) in kept.items():  # never overwritten
        assert (hold == copy).all(), j
    # a batch nobody held is refilled as batch j + ring; a held one never (a new batch takes its place)
    assert same == [j not in kept for j in range(n - ring)]
    assert recycled == n - ring - len(kept)


@pytest.mark.parametrize("recycle", [1, "yes", None])
def test_a_bad_recycle_argument_is_refused(recycle):
    with build() as replay:
        with pytest.raises(ValueError, match="recycle must be 'auto', True or False"):
            replay.batches(4, recycle=recycle)
        assert replay.sample(2).keys.shape == (2,)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_stopping_early_or_on_an_exception_leaves_nothing_behind(prefetch):
    before = threading.active_count()
    with build() as replay:
        it = replay.batches(4, prefetch=prefetch)
        for j, b in enumerate(it):
            if j == 4:
                break
        it.close()
        assert it.closed and threading.active_count() == before
        with pytest.raises(ZeroDivisionError):
            with replay.batches(4, prefetch=prefetch) as it2:
                for b in it2:
                    1 / 0
        assert threading.active_count() == before
        assert replay.stats()["total"]["items"] == 40 * COMM.size  # usable after both
    assert threading.active_count() == before


def test_other_calls_are_refused_while_the_iterator_runs():
    with build() as replay:
        with replay.batches(4, prefetch=1) as it:
            next(it)
            for call in (lambda: replay.sample(1), lambda: replay.stats(),
                         lambda: replay.update_priorities([], []),
                         lambda: replay.insert({"x": np.zeros((1, 2)), "r": np.zeros(1)})):
                with pytest.raises(RuntimeError, match="a batches\\(\\) iterator owns this replay"):
                    call()
            with pytest.raises(RuntimeError, match="owns this replay"):
                replay.batches(1)
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        with pytest.raises(ValueError, match=r"prefetch must be an integer in \[0, 65536\]"):
            replay.batches(1, prefetch=-1)


def test_an_error_of_a_sample_is_raised_at_its_batch_on_every_rank():
    with gm.Replay(SPEC, 100, seed=1) as replay:  # empty: the first sample fails everywhere
        with replay.batches(2, prefetch=2) as it:
            with pytest.raises(gm.EmptyReplayError):
                next(it)


def test_a_bad_update_of_one_rank_is_raised_on_every_rank():
    """The thread's update agrees on errors as Replay.update_priorities does: a bad key on rank 0 stops
    every rank's iterator at the same batch with rank 0's error, and close() leaves no thread."""
    with build() as replay:
        it = replay.batches(4, window=2, prefetch=1, limit=8)
        keys = next(it).keys.numpy().copy()
        if COMM.rank == 0:
            keys[0] = -1  # not a key of this replay
        it.update_priorities(keys, np.ones(len(keys)))  # applied before sample 3
        assert next(it).keys.shape == (4,)  # batch 2 was sampled before the update
        with pytest.raises(gm.InvalidKeyError, match="rank 0"):
            next(it)
        with pytest.raises(gm.InvalidKeyError):
            it.close()
        assert not it._thread.is_alive() and it.closed


def test_ragged_priorities_of_one_rank_are_refused_on_every_rank():
    """The iterator copied the priorities with numpy before any check: ragged ones raised numpy's ValueError on
    that rank alone, whose thread then missed the update, and the others' threads met it out of step (a
    CollectiveError, the replay lost). They now reach the thread's agreed update, refused on every rank."""
    with build() as replay:
        it = replay.batches(4, window=2, prefetch=1, limit=8)
        keys = next(it).keys.numpy().copy()
        pr = [[1.0], [1.0, 2.0], [1.0], [1.0]] if COMM.rank == 0 else np.ones(len(keys))
        it.update_priorities(keys, pr)
        assert next(it).keys.shape == (4,)
        with pytest.raises(gm.InvalidPriorityError, match="rank 0: priorities must be numbers"):
            next(it)
        with pytest.raises(gm.InvalidPriorityError):
            it.close()
        assert not it._thread.is_alive() and it.closed


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_close_closes_when_the_iterators_thread_failed():
    """An iterator still open at ``replay.close()`` whose thread fails (rank 0 gave an update the others did not:
    its thread's update meets nobody and times out): close raised the thread's error before closing anything,
    so the replay stayed open (its shard, node memory and transport; a ``with`` block left them so). Now it
    closes, then raises that error."""
    if COMM.size < 2:
        pytest.skip("needs two ranks")
    replay = build(timeout=2.0, comm=COMM.Dup())  # left out of step: not the world's (never freed: still pending)
    it = replay.batches(2, prefetch=1)
    batch = next(it)
    if COMM.rank == 0:
        it.update_priorities(batch.keys, np.ones(2))  # applied by its thread at close: the others give none
    t0 = time.monotonic()
    with pytest.raises(gm.CollectiveTimeoutError):  # rank 0: its thread's update; the others: the closing barrier
        replay.close()
    assert replay.closed and it.closed and time.monotonic() - t0 < 15
    replay.close()  # idempotent


def test_an_interrupted_iterator_close_is_finished_by_the_replays_close():
    """KeyboardInterrupt while ``it.close()`` waits for its thread (the last rank's thread samples on, with the
    others' threads, which wait for their loops): the iterator kept the replay, ``replay.close()`` set it
    closed, then raised RuntimeError (an iterator owns this replay) before closing anything, and a join
    interrupted left CPython 3.11 taking the running thread for ended. Now ``replay.close()`` waits for the
    thread, then closes as usual."""
    if COMM.size < 2:
        pytest.skip("needs two ranks")
    comm = COMM.Dup()
    replay = build(timeout=10.0, comm=comm)
    it = replay.batches(2, prefetch=2)
    for _ in range(3 if COMM.rank == COMM.size - 1 else 1):
        next(it)
    if COMM.rank == COMM.size - 1:  # its thread may run samples 4 and 5: the others' threads wait until 1 s
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                it.close()
        finally:
            timer.join()
            signal.signal(signal.SIGINT, old)
        replay.close()  # waits for the thread (the others take two more batches at 1 s), then closes
        assert not [t for t in threading.enumerate() if t.name == "gear_mpi-prefetch"]  # it ended
    else:
        time.sleep(1.0)
        next(it), next(it)
        replay.close()
    assert replay.closed and replay.shard.store.arena is None  # the shard was closed too
    comm.Free()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_that_stops_makes_the_others_time_out_not_hang():
    replay = build(timeout=2.0)
    it = replay.batches(2, prefetch=1)
    t0 = time.monotonic()
    if COMM.rank == 0:
        next(it)
        it.close()  # runs the samples already allowed (the same ones the others run), then stops
    elif COMM.rank % 2:
        with pytest.raises(gm.CollectiveTimeoutError):
            for _ in range(100):
                next(it)
        it.close()
    else:  # takes the two batches rank 0's close still samples, then stops too, one batch later than rank 0:
        next(it)  # its thread's third sample meets nobody; close says so (it returned as if all was well)
        next(it)
        with pytest.raises(gm.CollectiveTimeoutError, match="sample"):
            it.close()
    assert time.monotonic() - t0 < 30
    if COMM.rank == 0:  # the others broke off: its closing barrier times out too (and it still closes)
        with pytest.raises(gm.CollectiveTimeoutError, match="close"):
            replay.close()
    else:
        replay.close()  # a broken communicator: closes locally
    assert replay.closed

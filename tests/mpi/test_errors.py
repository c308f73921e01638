"""An invalid argument on one rank raises the same error on every rank; nothing changes.

An empty replay raises everywhere; a bad batch size, window, align, priority (NaN,
negative) or a foreign key on the last rank raises the same message on every rank;
afterwards the priorities are untouched and the replay still samples. Ranks constructed
with different arguments (a rate limiter, a capacity and a seed) are told which ones differ,
with rank 0's value and the first differing rank's; a bad constructor argument, a batch beyond the
machine's memory, an ``out=`` that is not a Batch, complex priorities and bad ``batches()`` arguments
on one rank raise on every rank too.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, expect_same_error, fill, make_replay, owner_of, shard_sizes


def test_invalid_arguments_fail_on_every_rank(force):
    replay = make_replay(gm.Prioritized(0.6, 0.4), force=force)
    # one rank samples its shard alone, whose message has no ranks in it
    expect_same_error(lambda: replay.sample(4, 3), gm.EmptyReplayError,
                      "empty on every rank" if SIZE > 1 else "the replay is empty")
    ref = fill(replay, shard_sizes()[RANK], seed=5)
    bad = SIZE - 1
    expect_same_error(lambda: replay.sample(-1 if RANK == bad else 2, 3), ValueError, f"rank {bad}: batch_size")
    if SIZE > 1:  # windows that differ between ranks (on one rank, 4 steps is a good window)
        expect_same_error(lambda: replay.sample(2, 3 + (RANK == bad)), ValueError, "window and align")
    expect_same_error(lambda: replay.sample(2, 3, "middle" if RANK == bad else "head"), ValueError, "align")
    batch = replay.sample(2, 3)
    pr = np.ones(len(batch))
    if RANK == bad:
        pr[0] = np.nan
    expect_same_error(lambda: replay.update_priorities(batch.meta_numpy()[0], pr), gm.InvalidPriorityError, "finite")
    if RANK == bad:
        pr[0] = -1.0
    expect_same_error(lambda: replay.update_priorities(batch.meta_numpy()[0], pr), gm.InvalidPriorityError, "non-negative")
    other = make_replay(gm.Prioritized(0.6, 0.4), force=force)
    other_key = other.insert({"obs": np.zeros((2, 3)), "step": np.zeros(2, np.int64),
                              "flag": np.zeros((2, 2), np.uint8)})
    if other.shard.tag == replay.shard.tag:
        other_key = int(other_key) ^ (1 << 62)  # same random tag (1 in 256): make it foreign anyway
    foreign = [other_key] if RANK == bad else []
    expect_same_error(lambda: replay.update_priorities(foreign, np.ones(len(foreign))), gm.InvalidKeyError,
                      "not issued by this replay")
    other.close()
    # nothing was changed by the failed calls, and the replay still works
    before = {k: p for k, (_, p) in ref.items() if owner_of(k) == RANK}
    if before:
        # a Prioritized index gives raw priorities back within float32 precision (gear_mpi.storage.table)
        np.testing.assert_allclose(replay.shard.priorities(list(before)), list(before.values()), rtol=2.0 ** -20,
                                   atol=0)
    batch = replay.sample(3, 4)
    assert len(batch) == 3
    replay.close()


def test_construction_names_the_argument_that_differs_and_both_values():
    """Ranks built with different rate limiters (or several different arguments) are told which, and how."""
    spec = gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4)
    ratio = gm.SampleToInsertRatio(4, 20, 200)
    if SIZE > 1:
        expect_same_error(lambda: gm.Replay(spec, 64, rate_limiter=ratio if RANK == 0 else None, timeout=20.0),
                          ValueError, f"rank 1 was constructed with other arguments than rank 0: rate_limiter "
                                      f"differs: rank 0 {ratio!r}, rank 1 None")
        bad = SIZE - 1
        expect_same_error(lambda: gm.Replay(spec, 64 + (RANK == bad), seed=1 + 4 * (RANK == bad), timeout=20.0),
                          ValueError, f"rank {bad} was constructed with other arguments than rank 0: capacity_steps "
                                      f"differs: rank 0 64, rank {bad} 65; seed differs: rank 0 1, rank {bad} 5")
    with gm.Replay(spec, 64, rate_limiter=gm.MinSize(1), timeout=20.0) as replay:  # the same everywhere: fine
        replay.insert({"obs": np.zeros((2, 3))})


def test_a_bad_constructor_argument_on_one_rank_fails_on_every_rank_at_once():
    """A value only that rank can see is wrong (mode, timeout, memory, spec) used to leave the others waiting
    until ``timeout`` (CollectiveTimeoutError); now every rank raises its error at once."""
    bad = SIZE - 1
    for kw, cls, what in [({"mode": "bogus"}, ValueError, "mode must be one of"),
                          ({"timeout": -1.0}, ValueError, "timeout must be a positive number"),
                          ({"memory": "nope"}, ValueError, "memory must be"),
                          ({"spec": {"obs": 1}}, TypeError, "spec must be a TrajectorySpec")]:
        args = {"spec": gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4), "capacity_steps": 64,
                "timeout": 20.0, **(kw if RANK == bad else {})}
        t0 = time.monotonic()
        expect_same_error(lambda: gm.Replay(**args), cls, f"Replay construction (arguments): rank {bad}: {what}")
        assert time.monotonic() - t0 < 10.0


def test_a_huge_batch_an_out_that_is_not_a_batch_or_complex_priorities_on_one_rank_fail_everywhere(force):
    """A batch beyond the machine's memory raised MemoryErrors of different messages (centralized: the ranks fell
    out of step until a timeout); ``out={...}`` an agreed AttributeError; complex priorities were taken."""
    bad = SIZE - 1
    for mode in ("decentralized", "centralized"):
        replay = make_replay(gm.Prioritized(0.6, 0.4), mode=mode, force=force)
        fill(replay, shard_sizes()[RANK], seed=5)
        expect_same_error(lambda: replay.sample(10**12 if RANK == bad else 2, 3), ValueError,
                          f"sample: rank {bad}: batch_size=1000000000000 windows of 3 steps would take")
        expect_same_error(lambda: replay.sample(2, 3, out={"obs": 1} if RANK == bad else None), TypeError,
                          f"sample: rank {bad}: out= must be a Batch")
        batch = replay.sample(2, 3)
        pr = np.ones(len(batch)) * 1j if RANK == bad else np.ones(len(batch))
        expect_same_error(lambda: replay.update_priorities(batch.meta_numpy()[0], pr), gm.InvalidPriorityError,
                          f"update_priorities: rank {bad}: priorities must be real numbers")
        assert replay.stats()["total"]["sampled"] == 2 * SIZE  # only the good sample counted
        assert len(replay.sample(3, 4)) == 3
        replay.close()


def test_rank_0_failing_to_select_in_the_centralized_mode_fails_on_every_rank_and_stays_in_step(force):
    """Rank 0 selects for everybody between the gather and the scatter: an error there (a MemoryError over a large
    replay) left the other ranks waiting in the scatter until their timeout. It now travels in the scatter: the
    same class and message on every rank at once, and the next sample works. So does rank 0's failure to allocate
    the gather's buffer, through the gather's counts. (One rank samples its own shard.)"""
    if SIZE == 1:
        pytest.skip("one rank has no centralized selection")
    for sampler in (gm.Prioritized(0.6, 0.4), gm.Fifo()):
        replay = make_replay(sampler, mode="centralized", force=force)
        fill(replay, shard_sizes()[RANK], seed=6)
        plan = replay.plans["centralized"]
        if RANK == 0:
            def choose(*args):
                raise MemoryError("Unable to allocate 15.6 GiB for an array")
            plan._choose = choose
        t0 = time.monotonic()
        expect_same_error(lambda: replay.sample(2, 3), MemoryError,
                          "sample (scatter choices): rank 0: Unable to allocate 15.6 GiB for an array")
        assert time.monotonic() - t0 < 10.0  # at once, not the 20 s timeout
        plan.__dict__.pop("_choose", None)
        if RANK == 0:  # the gather's own buffer (16 bytes an item) cannot be had: the others must not send into
            def state_buffer(items):  # nothing and wait
                raise MemoryError("Unable to allocate 14.9 GiB for an array")
            plan._state_buffer = state_buffer
        t0 = time.monotonic()
        expect_same_error(lambda: replay.sample(2, 3), MemoryError,
                          "sample (gather state): rank 0: rank 0 cannot hold the selection state of ")
        assert time.monotonic() - t0 < 10.0
        plan.__dict__.pop("_state_buffer", None)
        assert replay.stats()["total"]["sampled"] == 0  # nothing counted
        assert len(replay.sample(3, 4)) == 3  # the ranks are still in step
        replay.close()


def test_a_rank_that_cannot_read_its_figures_or_backlog_fails_every_rank_at_once():
    """``stats`` read a rank's figures, and ``sample`` its writers' backlog (an inbox probe), outside the error that
    the ranks agree on: a failure there raised on that rank alone while the others waited for its row until their
    timeout. Both are agreed now: the same error on every rank at once, and the next call works."""
    bad = SIZE - 1
    replay = make_replay(gm.Uniform())
    fill(replay, shard_sizes()[RANK], seed=8)
    feeds = replay._feeds

    def broken(*args):
        raise ValueError("the inbox probe failed")
    cases = [("figures", replay.stats, "stats")]
    if SIZE > 1:  # (one rank samples its own shard: no header)
        cases.append(("header_backlog", lambda: replay.sample(2, 3), "sample"))
    for name, call, what in cases:
        if RANK == bad:
            setattr(feeds, name, broken)
        t0 = time.monotonic()
        expect_same_error(call, ValueError, f"{what}: rank {bad}: the inbox probe failed")
        assert time.monotonic() - t0 < 10.0
        feeds.__dict__.pop(name, None)
    assert replay.stats()["total"]["items"] == sum(shard_sizes())
    assert len(replay.sample(2, 3)) == 2
    replay.close()


def test_batches_with_a_bad_or_differing_argument_on_one_rank_fails_on_every_rank():
    """batches() checked prefetch, limit and recycle on each rank alone: the others started sampling and timed
    out. A "batches" head now agrees them."""
    bad = SIZE - 1
    replay = make_replay(gm.Uniform())
    fill(replay, shard_sizes()[RANK], seed=2)
    expect_same_error(lambda: replay.batches(2, 3, prefetch=-1 if RANK == bad else 1), ValueError,
                      f"batches: rank {bad}: prefetch must be an integer in [0, 65536]")
    expect_same_error(lambda: replay.batches(2, 3, recycle="x" if RANK == bad else "auto"), ValueError,
                      f"batches: rank {bad}: recycle must be")
    if SIZE > 1:
        expect_same_error(lambda: replay.batches(2, 3, limit=3 + (RANK == bad)), ValueError,
                          "prefetch, limit and recycle must be the same on every rank")
    with replay.batches(2, 3, prefetch=1, limit=2) as it:
        assert [len(b) for b in it] == [2, 2]
    replay.close()


def test_a_save_to_another_path_on_one_rank_fails_everywhere_and_writes_nothing():
    """Each rank wrote its shard under its own path and rank 0 installed only its own, an incomplete checkpoint
    without an error; the save's head now compares the paths."""
    base = COMM.bcast(tempfile.mkdtemp(prefix="gear_save_paths_") if RANK == 0 else None)
    replay = make_replay(gm.Uniform())
    fill(replay, shard_sizes()[RANK], seed=4)
    bad = SIZE - 1
    mine = os.path.join(base, "other" if RANK == bad and SIZE > 1 else "ckpt")
    if SIZE > 1:
        expect_same_error(lambda: replay.save(mine, progress=False), ValueError,
                          f"save: every rank must give the same path (after os.path.abspath); rank(s) [{bad}]")
        COMM.Barrier()
        assert os.listdir(base) == [], os.listdir(base)  # nothing written, nothing left aside
    replay.save(os.path.join(base, "ckpt"), progress=False)  # the same path everywhere: fine
    again, _ = gm.Replay.load(os.path.join(base, "ckpt"), COMM)
    assert again.stats()["total"]["items"] == replay.stats()["total"]["items"]
    again.close()
    replay.close()
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(base)


def test_a_bad_or_differing_load_override_on_one_rank_fails_everywhere_at_once():
    """load checked its overrides (unknown names, timeout) on each rank before its first collective, and turned
    capacity_steps into an int after it: a bad one on one rank left the others waiting until their timeout."""
    base = COMM.bcast(tempfile.mkdtemp(prefix="gear_load_overrides_") if RANK == 0 else None)
    path = os.path.join(base, "ckpt")
    replay = make_replay(gm.Uniform())
    fill(replay, shard_sizes()[RANK], seed=6)
    replay.save(path, progress=False)
    replay.close()
    bad = SIZE - 1
    for kw, cls, what in [({"colour": "red"}, TypeError, f"load: rank {bad}: unexpected keyword argument"),
                          ({"timeout": -1}, ValueError, f"load: rank {bad}: timeout must be a positive number"),
                          ({"capacity_steps": "x"}, ValueError, f"load: rank {bad}: capacity_steps must be a "
                                                                 "positive integer"),
                          ({"progress": "x"}, TypeError, f"load: rank {bad}: progress must be")]:
        t0 = time.monotonic()
        expect_same_error(lambda: gm.Replay.load(path, COMM, **(kw if RANK == bad else {})), cls, what)
        assert time.monotonic() - t0 < 10.0
    if SIZE > 1:
        expect_same_error(lambda: gm.Replay.load(path, COMM, seed=1 + (RANK == bad)), ValueError,
                          f"load: the overrides must be the same on every rank (all but device, process_group, "
                          f"progress, memory_path); rank(s) [{bad}] gave others than rank 0")
    again, _ = gm.Replay.load(path, COMM, progress=RANK == 0, capacity_steps=500)  # per-rank progress: fine
    assert again.stats()["total"]["items"] == sum(shard_sizes())
    again.close()
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(base)


def test_replay_inserts_refuse_nan_and_inf_with_check_finite():
    spec = gm.TrajectorySpec({"obs": ((3,), "float32"), "n": ((), "int64")}, max_length=4)
    with gm.Replay(spec, 64, timeout=20.0) as replay:
        good = {"obs": np.zeros((2, 3), np.float32), "n": np.arange(2)}
        bad = {"obs": np.array([[0, 0, 0], [0, np.nan, 0]], np.float32), "n": np.arange(2)}
        replay.insert(good, check_finite=True)
        for call in (lambda: replay.insert(bad, check_finite=True),
                     lambda: replay.insert_many([good, bad], check_finite=True),
                     lambda: replay.insert_packed({"obs": np.concatenate([good["obs"], bad["obs"]]),
                                                   "n": np.arange(4)}, [2, 2], check_finite=True)):
            try:
                call()
            except ValueError as e:
                assert "column 'obs' holds nan at step 1" in str(e), str(e)
            else:
                raise AssertionError("a NaN passed check_finite=True")
            assert len(replay) == 1  # unchanged
        replay.insert(bad)  # off by default
        assert len(replay) == 2


def test_recover_without_ulfm_refuses_at_once_and_changes_nothing():
    """Without ULFM (MPICH; Open MPI started without ``mpiexec --with-ft ulfm``, as tests/test_openmpi.py runs
    this module) ``Replay.recover`` raises RecoveryError at once on every rank, saying why and pointing to a
    restart from the newest checkpoint; nothing is revoked and the replay goes on (tests/test_faults.py
    recovers under ULFM)."""
    replay = make_replay(gm.Uniform())
    fill(replay, shard_sizes()[RANK], seed=3)
    t0 = time.monotonic()
    expect_same_error(lambda: replay.recover("no-such-checkpoint"), gm.RecoveryError,
                      "restart the job from the newest checkpoint")
    assert time.monotonic() - t0 < 5.0
    assert not replay.closed and replay.comm.broken is None
    assert len(replay.sample(3, 2)) == 3
    assert replay.stats()["total"]["items"] == sum(shard_sizes())
    replay.close()


def test_a_rank_interrupted_between_the_collectives_of_a_sample_is_unusable_at_once():
    """KeyboardInterrupt on the last rank after the sample's head was agreed and before its exchange (here: as
    its owner makes the choices; a Ctrl-C lands there when it comes during that kernel). The communicator was
    left as usable: its next call posted a head that the others' pending exchange could meet, and waited out
    the deadline. Now the rank's next call raises at once, naming the interrupt, and close() is local; the
    others raise CollectiveTimeoutError within their deadline. The same for an update interrupted as its
    owner applies the routed priorities. Two ranks only (see the test below)."""
    if SIZE != 2:
        return
    bad = SIZE - 1

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    for call, part in (("sample", "make_choices"), ("update_priorities", "apply_priorities")):
        replay = gm.Replay(gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4), 64, timeout=2.0,
                           comm=COMM.Dup())  # left out of step: not the world's (never freed: still pending)
        try:
            if RANK == bad:  # it holds every item: the others need its choices, and its shard applies their keys
                replay.insert({"obs": np.ones((2, 3), np.float32)})
            keys = replay.sample(4).meta_numpy()[0]  # (the sample below asks 3: its first call takes the full path)
            COMM.Barrier()
            again = (lambda: replay.sample(3)) if call == "sample" else (lambda: replay.update_priorities(keys, np.full(len(keys), 2.0)))
            if RANK == bad:
                setattr(replay.shard, part, interrupted)
                with pytest.raises(KeyboardInterrupt):
                    again()
                delattr(replay.shard, part)
                t0 = time.monotonic()
                with pytest.raises(gm.CollectiveError, match=f"{call}: interrupted on rank {bad} by KeyboardInterrupt"):
                    again()
                replay.close()  # local: the communicator is broken
                assert time.monotonic() - t0 < 1.0
            else:
                t0 = time.monotonic()
                with pytest.raises(gm.CollectiveTimeoutError, match="not every rank"):
                    again()
                replay.close()
                assert time.monotonic() - t0 < 2.0 + 3.0
        finally:
            replay.close()
        COMM.Barrier()


def test_a_repeated_sample_interrupted_after_its_head_is_unusable_at_once():
    """The same for a repeated decentralized sample (gear_mpi/distributed/repeat.py, which counts and guards its
    calls itself): KeyboardInterrupt on the last rank after the heads' round, as it serves its draws. Its next call
    raises at once, naming the interrupt; the others raise CollectiveTimeoutError within their deadline."""
    if SIZE != 2:
        return
    from gear_mpi.distributed import repeat

    bad = SIZE - 1
    replay = gm.Replay(gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4), 64, gm.Prioritized(0.6, 0.4),
                       timeout=2.0, comm=COMM.Dup())  # left out of step: not the world's (never freed: still pending)
    try:
        replay.insert({"obs": np.ones((2, 3), np.float32)})
        batch = replay.sample(3)
        for _ in range(2):
            replay.sample(3, out=batch)
        record = replay._repeat.get(id(batch))
        assert record is not None  # the next call into it is a repeated one
        COMM.Barrier()
        if RANK == bad:
            kernels = record.kernels  # the record's kernels (kernels.compiled.KernelCalls), the choices' round second
            settled = kernels.runs[repeat._CHOICES]

            def interrupting(*args):
                raise KeyboardInterrupt

            kernels.runs[repeat._CHOICES] = interrupting
            with pytest.raises(KeyboardInterrupt):
                replay.sample(3, out=batch)
            kernels.runs[repeat._CHOICES] = settled
            t0 = time.monotonic()
            with pytest.raises(gm.CollectiveError, match=f"sample: interrupted on rank {bad} by KeyboardInterrupt"):
                replay.sample(3, out=batch)
            replay.close()  # local: the communicator is broken
            assert time.monotonic() - t0 < 1.0
        else:
            t0 = time.monotonic()
            with pytest.raises(gm.CollectiveTimeoutError, match="not every rank"):
                replay.sample(3, out=batch)
            replay.close()
            assert time.monotonic() - t0 < 2.0 + 3.0
    finally:
        replay.close()
    COMM.Barrier()


def test_a_rank_interrupted_in_a_collective_is_unusable_at_once_and_closes_locally():
    """KeyboardInterrupt (SIGINT) on the last rank inside a sample: the others raise CollectiveTimeoutError
    within their deadline. The interrupted rank left that collective pending, yet its replay stayed usable:
    its next call posted a collective that the others' pending one could meet, and its close() waited out the
    deadline in the closing barrier and raised. Now its next call raises at once and close() is local.

    Two ranks only: with more, the others may finish that sample without the interrupted rank (its header row
    was on the node board, and its shard is read from shared memory), then wait for it in their node fence."""
    if SIZE != 2:
        return
    bad = SIZE - 1
    replay = gm.Replay(gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4), 64, timeout=2.0,
                       comm=COMM.Dup())  # left out of step: not the world's (never freed: still pending)
    try:
        replay.insert({"obs": np.ones((2, 3), np.float32)})
        COMM.Barrier()
        if RANK == bad:
            old = signal.signal(signal.SIGINT, signal.default_int_handler)
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    replay.sample(4)  # the others arrive after 1 s: interrupted while it waits for them
            finally:
                timer.join()
                signal.signal(signal.SIGINT, old)
            t0 = time.monotonic()
            with pytest.raises(gm.CollectiveError, match=f"sample.*: interrupted on rank {bad} by KeyboardInterrupt"):
                replay.sample(4)
            replay.close()  # local: the communicator is broken
            assert time.monotonic() - t0 < 1.0
        else:
            time.sleep(1.0)
            t0 = time.monotonic()
            with pytest.raises(gm.CollectiveTimeoutError, match="not every rank"):
                replay.sample(4)
            replay.close()
            assert time.monotonic() - t0 < 2.0 + 3.0
    finally:
        replay.close()
    COMM.Barrier()

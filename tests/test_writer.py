"""Writers and the owner's ingest point, with real processes and real shared memory (no MPI here).

The owner side is a Shard with a WriterIntake (what a Replay rank holds); the actors are
``tests/writer_actor.py`` processes. Multi-rank behaviour (rate limiter, collectives,
actor ranks over MPI) is in tests/mpi/test_feeds.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.distributed import header
from gear_mpi.feeds import intake, replay_feeds

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from writer_actor import MAX_LENGTH, SPEC_COLUMNS, episode  # noqa: E402

SPEC = gm.TrajectorySpec({k: (s, d) for k, (s, d) in SPEC_COLUMNS.items()}, max_length=MAX_LENGTH)


def segments(address: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(address))


def owner_process(shard: str, then: str) -> subprocess.Popen:
    """An owner in its own process: a WriterIntake over ``shard`` (an expression over ``spec``, the actors'
    spec); it prints its address, then runs ``then`` (code)."""
    code = ("import sys, time, numpy as np, gear_mpi as gm\n"
            f"sys.path.insert(0, {str(HERE)!r})\n"
            "from writer_actor import SPEC_COLUMNS, MAX_LENGTH\n"
            "from gear_mpi.feeds import intake\n"
            "spec = gm.TrajectorySpec({k: (s, d) for k, (s, d) in SPEC_COLUMNS.items()}, max_length=MAX_LENGTH)\n"
            f"point = intake.WriterIntake({shard})\n"
            "print(point.address, flush=True)\n"
            f"{then}\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def actor(address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "writer_actor.py"), address, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def drain_until(point: intake.WriterIntake, test, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not test():
        point.drain(np.inf)
        assert time.monotonic() < deadline, "timed out waiting for the writers"
        time.sleep(0.002)


def stored(shard: gm.Shard) -> dict[tuple[int, int], dict]:
    """Every live trajectory of the shard, by (writer seed, episode index) read from its x column."""
    out = {}
    for key in shard.live_keys():
        t = shard.get(int(key))
        seed, index = int(t["x"][0, 0]), int(t["x"][0, 1])
        assert (seed, index) not in out
        out[(seed, index)] = t
    return out


@pytest.fixture
def owner():
    shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
    point = intake.WriterIntake(shard)
    yield shard, point
    point.close()
    shard.close()
    assert segments(point.address) == [], "the ingest point left segments behind"


def test_every_episode_of_several_writers_arrives_bit_exact(owner):
    shard, point = owner
    procs = [actor(point.address, "--seed", str(s), "--episodes", "40", "--staging-steps", "64") for s in (1, 2, 3)]
    drain_until(point, lambda: all(p.poll() is not None for p in procs))
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0 and "DONE" in out, (out, err)
        assert "TORCH not imported" in err, err  # a writer process never loads torch (2.5 s, ~300 MB here)
    point.drain(np.inf)
    got = stored(shard)
    assert len(got) == 120 and point.ingested == 120
    for (seed, index), t in got.items():
        cols, priority = episode(seed, index)
        for name, want in cols.items():
            assert t[name].dtype == SPEC[name].dtype
            np.testing.assert_array_equal(t[name], want.astype(SPEC[name].dtype))
    keys = shard.live_keys()
    pr = shard.priorities(keys)
    want_pr = [episode(int(shard.get(int(k))["x"][0, 0]), int(shard.get(int(k))["x"][0, 1]))[1] for k in keys]
    np.testing.assert_array_equal(pr, want_pr)


def test_a_writer_killed_mid_episode_loses_only_its_open_episode(owner):
    shard, point = owner
    p = actor(point.address, "--seed", "7", "--episodes", "5", "--then-open", "3")
    stop = threading.Event()
    drainer = threading.Thread(target=lambda: drain_until(point, stop.is_set))  # the owner keeps ingesting
    drainer.start()
    try:
        lines = [p.stdout.readline().strip(), p.stdout.readline().strip()]
    finally:
        stop.set()
        drainer.join()
    assert lines == ["DONE", "READY"], (lines, p.stderr.read() if p.poll() is not None else "")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    drain_until(point, lambda: not point.writers, seconds=10)  # reaped: its slot and segment freed
    assert sorted(stored(shard)) == [(7, i) for i in range(5)]
    assert segments(point.address) == [point.address]
    # the owner goes on: a new writer takes the freed slot
    q = actor(point.address, "--seed", "8", "--episodes", "2")
    drain_until(point, lambda: q.poll() is not None)
    assert q.returncode == 0
    point.drain(np.inf)
    assert sorted(stored(shard)) == [(7, i) for i in range(5)] + [(8, 0), (8, 1)]


def test_bad_steps_are_rejected_in_the_actor(owner):
    shard, point = owner
    good = {"x": np.zeros(3, np.float32), "img": np.zeros((4, 4), np.uint8), "r": 1.0}
    with gm.Writer(point.address, timeout=5) as w:
        assert w.spec == SPEC
        cases = [({k: v for k, v in good.items() if k != "img"}, "missing column 'img'"),
                 ({**good, "extra": 1}, "unknown column(s) ['extra']"),
                 ({**good, "x": np.zeros(4, np.float32)}, "column 'x' has shape (4,)"),
                 ({**good, "img": np.zeros((4, 4), np.float64)}, "cannot be cast safely to uint8"),
                 ({**good, "r": "a"}, "column 'r' has dtype <U1"),
                 ([1, 2], "expected a mapping")]
        for step, text in cases:
            with pytest.raises(gm.InvalidTrajectoryError, match=None) as info:
                w.append(step)
            assert text in str(info.value), (text, str(info.value))
        with pytest.raises(gm.InvalidTrajectoryError, match="no step was appended"):
            w.end_episode()
        for _ in range(MAX_LENGTH):
            w.append(good)
        with pytest.raises(gm.InvalidTrajectoryError, match=f"more than max_length={MAX_LENGTH}"):
            w.append(good)
        with pytest.raises(gm.InvalidPriorityError):
            w.end_episode(priority=float("nan"))
        with pytest.raises(gm.InvalidPriorityError, match="priority must be a number, got '2'"):
            w.end_episode(priority="2")  # text is refused, not parsed
        with pytest.raises(gm.InvalidTrajectoryError, match="an episode of 16 steps is open"):
            w.insert({k: np.asarray(v)[None] for k, v in good.items()})
        w.end_episode(priority=2.0)
        with pytest.raises(gm.InvalidTrajectoryError, match="column 'x' has shape"):
            w.insert({**{k: np.asarray(v)[None] for k, v in good.items()}, "x": np.zeros((1, 2))})
    drain_until(point, lambda: len(shard) == 1)
    t = shard.get(int(shard.live_keys()[0]))
    assert len(t["r"]) == MAX_LENGTH and shard.priorities(shard.live_keys())[0] == 2.0


def test_check_finite_refuses_nan_and_inf_in_the_actor(owner):
    """Writer(check_finite=True): a step or trajectory holding NaN or inf is refused in the actor, naming the
    column and the step, and nothing of it reaches the replay; by default such values pass."""
    shard, point = owner
    step = {"x": np.zeros(3, np.float32), "img": np.zeros((4, 4), np.uint8), "r": 0.5}
    with gm.Writer(point.address, timeout=5, check_finite=True) as w:
        w.append(step)
        w.append(step)
        with pytest.raises(ValueError, match=re.escape("append: column 'r' holds nan at step 2 of the open episode")):
            w.append({**step, "r": float("nan")})
        with pytest.raises(gm.InvalidTrajectoryError, match="column 'x' holds inf at step 2"):
            w.append({**step, "x": np.array([0, np.inf, 0], np.float32)})
        w.append({**step, "r": 1.5})
        w.end_episode()  # the three good steps only
        bad = {"x": np.zeros((4, 3), np.float32), "img": np.zeros((4, 4, 4), np.uint8), "r": np.ones(4)}
        bad["x"][2, 0] = -np.inf
        with pytest.raises(gm.InvalidTrajectoryError, match=re.escape("insert: column 'x' holds -inf at step 2")):
            w.insert(bad)
        assert w.episodes == 1
    drain_until(point, lambda: len(shard) == 1)
    t = shard.get(int(shard.live_keys()[0]))
    assert t["r"].tolist() == [0.5, 0.5, 1.5] and np.isfinite(t["x"]).all()
    with gm.Writer(point.address, timeout=5) as w:  # off by default: passed through as given
        w.insert(bad)
    drain_until(point, lambda: len(shard) == 2)
    assert sum(np.isinf(shard.get(int(k))["x"]).sum() for k in shard.live_keys()) == 1


def test_backpressure_blocks_then_times_out_and_the_writer_goes_on(owner):
    shard, point = owner
    step = {"x": np.zeros(3, np.float32), "img": np.zeros((4, 4), np.uint8), "r": 0.0}
    w = gm.Writer(point.address, timeout=0.3, staging_steps=MAX_LENGTH)
    for _ in range(MAX_LENGTH):
        w.append(step)
    w.end_episode()
    t0 = time.monotonic()
    with pytest.raises(gm.WriterTimeoutError, match="no room in its staging area"):
        w.append(step)  # the owner has not ingested: the ring is full
    assert 0.25 < time.monotonic() - t0 < 5
    assert point.drain(np.inf) == 1
    w.append(step)  # room again; the failed append added nothing
    w.end_episode()
    assert point.drain(np.inf) == 1
    assert [len(shard.get(int(k))["r"]) for k in shard.live_keys()] == [MAX_LENGTH, 1]
    w.close()


def test_a_closed_replay_stops_its_writers_at_once(owner):
    shard, point = owner
    p = actor(point.address, "--seed", "3", "--episodes", "50", "--staging-steps", "16", "--timeout", "60")
    drain_until(point, lambda: point.writers)  # attached; now nobody drains: it blocks on a full ring
    time.sleep(0.3)
    t0 = time.monotonic()
    point.close()
    out, _ = p.communicate(timeout=20)
    assert time.monotonic() - t0 < 10
    assert p.returncode == 3 and "ERROR WriterError" in out and "its replay was closed" in out, out
    with pytest.raises(gm.WriterError, match="no ingest point"):
        gm.Writer(point.address)


def test_a_dead_owner_gives_its_writers_an_error_within_their_timeout(tmp_path):
    owner = owner_process("gm.Shard(spec, 1000)", "time.sleep(600)")
    address = owner.stdout.readline().strip()
    try:
        w = actor(address, "--episodes", "50", "--staging-steps", "16", "--timeout", "60")
        time.sleep(1.0)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        out, _ = w.communicate(timeout=20)
        assert w.returncode == 3 and "ERROR WriterError" in out and "died" in out, out
    finally:
        owner.kill()
        for name in segments(address):  # the dead owner could not unlink its registry
            os.unlink(os.path.join("/dev/shm", name))


def test_writer_arguments():
    with pytest.raises(gm.WriterError, match="not a writer address"):
        gm.Writer("not-an-address")
    with pytest.raises(gm.WriterError, match="no ingest point"):
        gm.Writer("gear_mpi_in_0000000000000000")
    # hostile addresses get WriterError too, never a ValueError, OSError or numpy error (issue 30, item 5)
    with pytest.raises(gm.WriterError, match="not a writer address"):
        gm.Writer("gear_mpi_in_00\x0000")
    with pytest.raises(gm.WriterError, match="not a writer address"):
        gm.Writer("gear_mpi_in_" + "x" * 300)
    short = "gear_mpi_in_short_" + os.urandom(4).hex()
    with open(f"/dev/shm/{short}", "wb") as f:  # a 100-byte segment under a writer registry's name
        f.write(b"\1" * 100)
    try:
        with pytest.raises(gm.WriterError, match="is not a gear_mpi writer registry \\(100 bytes"):
            gm.Writer(short)
    finally:
        os.unlink(f"/dev/shm/{short}")
    shard = gm.Shard(SPEC, 100)
    point = intake.WriterIntake(shard)
    try:
        for steps in (3, float(MAX_LENGTH + 1), str(MAX_LENGTH + 1), float("inf")):  # int() took the last three
            with pytest.raises(ValueError, match="staging_steps must be an integer >= max_length"):
                gm.Writer(point.address, staging_steps=steps)
        with pytest.raises(ValueError, match="timeout"):
            gm.Writer(point.address, timeout=0)
        assert point.writers == {} and segments(point.address) == [point.address]
    finally:
        point.close()


def test_writers_of_a_killed_learner_stop_within_their_timeout_and_clean_up():
    """Issue 30, item 1: the learner (an owner that drains, as a Replay's collectives do) is SIGKILLed while a
    fast and a slow actor write; each gets WriterError ("died") within its timeout, not when its staging area
    fills, and the registry and staging segments are gone from /dev/shm afterwards."""
    owner = owner_process("gm.Shard(spec, 4000, gm.Fifo(), max_items=1000)",
                          "while True:\n    point.drain(np.inf); time.sleep(0.005)")
    address = owner.stdout.readline().strip()
    timeout = 4.0
    try:
        fast = actor(address, "--episodes", "100000000", "--timeout", str(timeout))
        slow = actor(address, "--episodes", "100000000", "--step-sleep", "0.02", "--timeout", str(timeout), "--seed", "1")
        time.sleep(2.0)
        assert fast.poll() is None and slow.poll() is None, "both actors still write while the learner lives"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        killed = time.monotonic()
        for w in (fast, slow):
            out, err = w.communicate(timeout=timeout + 10)
            raised = re.search(r"^ERROR_AT ([0-9.]+)$", out, re.M)
            assert raised, (out, err[-2000:])
            assert float(raised[1]) - killed < timeout + 3, f"an actor went on past its timeout:\n{out}"
            assert w.returncode == 3 and "ERROR WriterError" in out and "died" in out, (out, err[-2000:])
        assert segments(address) == [], "a dead learner's writers remove its segments"
    finally:
        owner.kill()
        for name in segments(address):
            os.unlink(os.path.join("/dev/shm", name))


def test_writer_slots_are_reaped_with_nothing_pending(owner):
    """Issue 30, item 2: 200 writers opened and closed in sequence (more than the 128 slots) all open, with the
    owner only looking (backlog, as a collective with nothing to ingest does); a killed actor that its parent
    has not waited for (a zombie) loses its slot too."""
    shard, point = owner
    for i in range(200):
        w = gm.Writer(point.address, staging_steps=32)
        w.close()
        point.backlog()
        assert len(point.writers) == 0, f"writer {i}: closed writers keep their slots"
    assert segments(point.address) == [point.address]
    zombie = actor(point.address, "--episodes", "0", "--then-open", "2")
    assert [zombie.stdout.readline().strip() for _ in range(2)] == ["DONE", "READY"]
    point.backlog()
    assert len(point.writers) == 1
    os.kill(zombie.pid, signal.SIGKILL)  # not waited for: a zombie, which os.kill(pid, 0) still finds
    deadline = time.monotonic() + 5
    while point.writers and time.monotonic() < deadline:
        time.sleep(0.05)
        point.backlog()
    assert point.writers == {} and segments(point.address) == [point.address], "a zombie writer keeps its slot"
    zombie.wait()



def test_a_backlog_larger_than_the_shard_is_drained_whole():
    """A shard of 2 slots (and steps for about 2 episodes) drained one batch of what it holds per writer, so
    ``drain(inf)`` (``Replay.ingest``, a collective's drain, ``clear``'s) left the rest staged: 9 ended episodes
    took 5 drains, and episodes ended before a ``clear()`` entered after it. Now one drain takes every ended
    episode; the shard keeps the newest, the older ones counted as evicted."""
    shard = gm.Shard(SPEC, 2 * MAX_LENGTH, gm.Fifo(), max_items=2)
    point = intake.WriterIntake(shard)
    try:
        with gm.Writer(point.address, staging_steps=16 * MAX_LENGTH) as w:
            for i in range(9):
                w.insert(episode(7, i)[0], 1.0 + i)
            assert point.drain(np.inf) == 9 and point.backlog() == 0
            assert shard.stats()["inserted"] == 9 and point.ingested == 9
            assert sorted(stored(shard)) == [(7, 7), (7, 8)]  # the newest two
            for i in range(9, 12):
                w.insert(episode(7, i)[0])
            assert point.drain(2) == 2 and point.backlog() == 1  # a budget still bounds it
            assert point.drain(np.inf) == 1
    finally:
        point.close()
        shard.close()


def test_an_actor_ranks_backlog_larger_than_the_shard_is_drained_whole():
    """The same for an actor rank's inbox (MpiWriter's episodes, sent here to this process itself on
    COMM_SELF): a drain took one shard-full, so 9 episodes that had arrived before a ``clear()`` entered after
    it. Now one drain takes all that arrived (one acknowledgement, the count stored); a budget bounds it."""
    from mpi4py import MPI

    from gear_mpi.feeds import remote

    def message(cols, priority):
        head = [np.array([len(cols["r"])], np.int64).view(np.uint8), np.array([priority], np.float64).view(np.uint8)]
        return np.concatenate(head + [np.ascontiguousarray(cols[c.name], c.dtype).reshape(-1).view(np.uint8)
                                      for c in SPEC.columns])

    comm = MPI.COMM_SELF.Dup()
    shard = gm.Shard(SPEC, 2 * MAX_LENGTH, gm.Fifo(), max_items=2)
    box = remote.RemoteInbox(comm, shard, timeout=5)
    try:
        bufs = [message(*episode(7, i)) for i in range(12)]
        sends = [comm.Isend(b, dest=0, tag=remote.TAG_EPISODE) for b in bufs[:9]]
        assert box.drain(np.inf) == 9 and box.backlog() == 0
        assert shard.stats()["inserted"] == 9 and box.ingested == 9
        assert sorted(stored(shard)) == [(7, 7), (7, 8)]  # the newest two
        sends += [comm.Isend(b, dest=0, tag=remote.TAG_EPISODE) for b in bufs[9:]]
        assert box.drain(2) == 2 and box.backlog() == 1  # a budget still bounds it
        assert box.drain(np.inf) == 1
        MPI.Request.Waitall(sends)
        acks, word = [], np.empty(1, np.int64)
        while comm.Iprobe(source=0, tag=remote.TAG_ACK):
            comm.Recv(word, source=0, tag=remote.TAG_ACK)
            acks.append(int(word[0]))
        assert acks == [9, 11, 12]  # one per drain: the episodes stored so far
    finally:
        box._sends, box.actors = [], {}  # nobody to tell: the stand-in actor is this process
        box.close()
        shard.close()
        comm.Free()


def one_step(seed: int, index: int) -> dict:
    """The first step of episode ``index`` of writer ``seed``, as a one-step trajectory."""
    return {k: v[:1] for k, v in episode(seed, index)[0].items()}


def test_the_rate_limiter_holds_a_writer_at_its_share_of_the_insert_budget():
    """Issue 30, item 7: with a rate limiter, a writer's staged episodes are capped at the rank's insert allowance
    plus the slack; end_episode then waits (or raises after hold_timeout, the episode still open), and a sample
    header, which gives the rank more allowance, lets it go on."""
    lim = gm.SampleToInsertRatio(2.0, 10, 10.0)  # band [10, 30] windows; 15 items may enter before any sample
    shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
    feeds = replay_feeds.ReplayFeeds(shard, 0, 1, lambda: None, lim, 60.0)
    try:
        w = gm.Writer(feeds.writer_address(), hold_timeout=0.3)
        assert feeds.slack == 1  # no sample call yet
        for i in range(16):  # allowance 15 + slack 1
            w.insert(one_step(1, i))
        t0 = time.monotonic()
        with pytest.raises(gm.WriterTimeoutError, match="held back by the replay's rate limiter for 0.3 s"):
            w.insert(one_step(1, 16))
        assert 0.25 < time.monotonic() - t0 < 5 and w.staged == 16 and w.held_seconds >= 0.25
        assert feeds.feed() == 15  # the allowance; one stays staged until samples make room
        fig = feeds.figures()
        assert (fig["staged"], fig["staged_steps"], fig["writers"], fig["writers_draining"]) == (1, 1, 1, 0)
        assert 0 <= fig["ingested_age"] < 5
        w.append({k: v[0] for k, v in one_step(1, 16).items()})
        with pytest.raises(gm.WriterTimeoutError, match="held back"):
            w.end_episode()  # the episode stays open
        w.hold_timeout = None  # now wait as long as the owner runs
        done = threading.Event()
        ender = threading.Thread(target=lambda: (w.end_episode(), done.set()))
        ender.start()
        time.sleep(0.3)
        assert not done.is_set(), "a writer at its cap must wait"
        head = np.zeros((1, header.HEADER_WIDTH))
        head[0, [header.BATCH, header.INSERTED, header.ITEMS, header.SAMPLED, header.BACKLOG]] = 4, 15, 15, 20, 1
        assert not feeds.admit(head)  # the call of 4 windows waits for inserts: 10 may enter now
        assert feeds.slack == 4  # two calls of 4 windows at 2 samples per insert
        ender.join(10)
        assert done.is_set() and w.staged == 2
        assert feeds.feed() == 2 and feeds.figures()["staged"] == 0
        w.close()
    finally:
        feeds.close()
        shard.close()
    # writer_slack= sets the slack
    shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
    feeds = replay_feeds.ReplayFeeds(shard, 0, 1, lambda: None, lim, 60.0, writer_slack=5)
    try:
        with gm.Writer(feeds.writer_address(), hold_timeout=0.2) as w:
            for i in range(20):
                w.insert(one_step(2, i))
            with pytest.raises(gm.WriterTimeoutError, match="held back"):
                w.insert(one_step(2, 20))
    finally:
        feeds.close()
        shard.close()
    with pytest.raises(ValueError, match="writer_slack must be None or an integer >= 0"):
        replay_feeds.ReplayFeeds(shard, 0, 1, lambda: None, lim, 60.0, writer_slack=-1)


def test_no_hold_without_a_bounded_rate_limiter():
    """Without a limiter, or with MinSize, writers are held only by a full staging area (as before)."""
    for lim in (None, gm.MinSize(5)):
        shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
        feeds = replay_feeds.ReplayFeeds(shard, 0, 1, lambda: None, lim, 60.0)
        try:
            with gm.Writer(feeds.writer_address(), hold_timeout=0.2) as w:
                for i in range(300):
                    w.insert(one_step(2, i))
                assert w.staged == 300 and w.held_seconds == 0
            assert feeds.feed() == 300
        finally:
            feeds.close()
            shard.close()


def test_a_dead_writer_with_a_backlog_is_reported_draining(owner):
    """Issue 30, item 7: a writer whose process died with ended episodes staged is counted apart from the live
    writers until those episodes are in; the backlog (episodes, steps) and the age of the newest ingested step
    are reported; close() says how many staged episodes it discards."""
    shard, point = owner
    live = actor(point.address, "--seed", "1", "--episodes", "4", "--no-flush", "--then-open", "1")
    dead = actor(point.address, "--seed", "2", "--episodes", "5", "--no-flush", "--then-open", "1")
    try:
        check_draining(shard, point, live, dead)
    finally:
        for p in (live, dead):
            p.kill()
            p.wait()


def check_draining(shard, point, live, dead):
    for p in (live, dead):
        assert [p.stdout.readline().strip() for _ in range(2)] == ["DONE", "READY"]
    steps = sum(len(episode(s, i)[0]["r"]) for s, n in ((1, 4), (2, 5)) for i in range(n))
    fig = point.figures()
    assert (fig["writers"], fig["writers_draining"], fig["staged"], fig["staged_steps"]) == (2, 0, 9, steps)
    assert fig["ingested_age"] == float("inf")  # nothing ingested yet
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    deadline = time.monotonic() + 5
    while point.figures()["writers_draining"] == 0:
        assert time.monotonic() < deadline, "a dead writer with a backlog is not reported draining"
        time.sleep(0.05)
    fig = point.figures()
    assert (fig["writers"], fig["writers_draining"], fig["staged"]) == (1, 1, 9)
    assert point.drain(np.inf) == 9
    fig = point.figures()
    assert (fig["writers"], fig["writers_draining"], fig["staged"], fig["staged_steps"]) == (1, 0, 0, 0)
    assert 0 <= fig["ingested_age"] < 10
    assert sorted(stored(shard)) == [(1, i) for i in range(4)] + [(2, i) for i in range(5)]
    # a new writer stages two episodes that nobody ingests: closing the ingest point discards them
    with gm.Writer(point.address) as w:
        w.insert(one_step(3, 0))
        w.insert(one_step(3, 1))
        assert point.close() == 2


def test_a_held_writer_ends_when_its_replay_closes_or_its_owner_dies(owner):
    """A writer waiting in the rate limiter's hold (no hold_timeout) still gets WriterError at once when its
    replay closes, and within 0.1 s of looking when its owner process dies; it never hangs."""
    shard, point = owner
    point.registry.set_hold(2)  # what a rank under a rate limiter publishes: each writer may stage 2 episodes
    p = actor(point.address, "--episodes", "50", "--no-flush")
    deadline = time.monotonic() + 20
    while point.backlog() < 2:
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(0.3)
    assert point.backlog() == 2 and p.poll() is None, "a writer at its cap waits"
    t0 = time.monotonic()
    point.close()
    out, _ = p.communicate(timeout=20)
    assert time.monotonic() - t0 < 5
    assert p.returncode == 3 and "ERROR WriterError" in out and "its replay was closed" in out, out

    learner = owner_process("gm.Shard(spec, 1000)", "point.registry.set_hold(2)\ntime.sleep(600)")
    address = learner.stdout.readline().strip()
    try:
        w = actor(address, "--episodes", "50", "--no-flush")
        time.sleep(2.0)  # it starts, stages two episodes and waits
        assert w.poll() is None
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait()
        t0 = time.monotonic()
        out, _ = w.communicate(timeout=20)
        assert time.monotonic() - t0 < 5
        assert w.returncode == 3 and "ERROR WriterError" in out and "died" in out, out
    finally:
        learner.kill()
        for name in segments(address):
            os.unlink(os.path.join("/dev/shm", name))


def test_adopt_moves_the_ingest_point_and_its_writer_to_another_shard():
    """ReplayFeeds.adopt (Replay.recover's hand-over): a writer of the old feeds goes on, at the same address,
    into the new shard, episodes staged before the hand-over included; bad hand-overs are refused, unchanged."""
    old_shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
    new_shard = gm.Shard(SPEC, 4000, gm.Fifo(), max_items=1000)
    old = replay_feeds.ReplayFeeds(old_shard, 0, 1, lambda: None, None, 60.0)
    new = replay_feeds.ReplayFeeds(new_shard, 0, 1, lambda: None, None, 60.0)
    other_spec = gm.TrajectorySpec({"y": ((), "float32")}, max_length=4)
    stranger_shard = gm.Shard(other_spec, 100, gm.Fifo())
    stranger = replay_feeds.ReplayFeeds(stranger_shard, 0, 1, lambda: None, None, 60.0)
    try:
        assert new.adopt(replay_feeds.ReplayFeeds(old_shard, 0, 1, lambda: None, None, 60.0)) is None  # none there
        address = old.writer_address()
        writer = gm.Writer(address, timeout=10.0)
        writer.insert(*episode(1, 0))  # staged before the hand-over
        with pytest.raises(ValueError, match="spec differs"):
            stranger.adopt(old)
        assert old.intake is not None and stranger.intake is None
        assert new.adopt(old) == address and old.intake is None
        with pytest.raises(ValueError, match="already has an ingest point"):
            new.adopt(new)
        writer.insert(*episode(1, 1))  # after it
        drain_until(new.intake, lambda: len(new_shard) == 2)
        assert sorted(stored(new_shard)) == [(1, 0), (1, 1)] and len(old_shard) == 0
        assert new.writer_address() == address
        writer.close()
    finally:
        old.close(), new.close(), stranger.close()
        for s in (old_shard, new_shard, stranger_shard):
            s.close()


class _Comm:
    """Stands for an mpi4py communicator in ReplayFeeds.adopt (which asks only whether it was revoked)."""

    def __init__(self, revoked: bool):
        self.revoked = revoked

    def Iprobe(self, **kwargs):
        return False

    def Is_revoked(self):
        return self.revoked


def test_adopt_moves_the_actor_ranks_inboxes_but_not_one_on_a_revoked_communicator():
    """Replay.recover's hand-over of actor ranks: the inboxes (accept_remote) move to the new shard, so the
    actors' MpiWriter go on; an inbox on a revoked communicator (the old replay's own) stays with the old
    feeds, which close it; feeds with only inboxes (no ingest point) are taken over too."""
    old_shard = gm.Shard(SPEC, 400, gm.Fifo(), max_items=100)
    new_shard = gm.Shard(SPEC, 400, gm.Fifo(), max_items=100)
    old = replay_feeds.ReplayFeeds(old_shard, 0, 1, lambda: None, None, 60.0)
    new = replay_feeds.ReplayFeeds(new_shard, 0, 1, lambda: None, None, 60.0)
    try:
        live, revoked = _Comm(False), _Comm(True)
        old.accept_remote(live)
        old.accept_remote(revoked)
        assert new.adopt(old) is None  # no ingest point to take over
        assert [b.comm for b in new.inboxes] == [live] and new.inboxes[0].shard is new_shard
        assert [b.comm for b in old.inboxes] == [revoked]
        with pytest.raises(ValueError, match="actor ranks"):
            new.adopt(old)
        assert [b.comm for b in old.inboxes] == [revoked]  # refused: nothing taken
    finally:
        old.inboxes, new.inboxes = [], []  # stand-in communicators: nothing to tell
        old.close(), new.close()
        old_shard.close(), new_shard.close()

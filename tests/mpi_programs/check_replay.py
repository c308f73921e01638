"""Multi-rank checks of gm.Replay, run as ``mpiexec -n K python check_replay.py SCENARIO [--force]``.

Every rank prints ``PASS <check> rank=R`` for each check it passed; any failure
raises (mpiexec then exits non-zero). tests/test_replay_mpi.py starts this with a
timeout and reads the output.

Scenarios:
- ``exact``: bit-exact windows for every mode and selector, uneven shards with an
  empty one, per-rank batch sizes (0 included), head/tail/random alignment;
  global weights identical on every rank; priority updates reach their owners;
  stale keys dropped and counted; the global order of Fifo/Lifo/Max/MinPriority.
- ``chisquare``: the decentralized and centralized distributions over all shards
  match p_i / sum p exactly (chi-square, fixed seeds).
- ``errors``: an invalid argument on one rank raises the same error on every rank,
  an empty replay raises everywhere, and the replay still works afterwards.
- ``timeout``: the last rank never calls ``sample``; the others raise
  CollectiveTimeoutError within the timeout.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi import keys as keyspace

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
FORCE = "--force" in sys.argv
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "step": ((), "int64"), "flag": ((2,), "uint8")}, max_length=12)


def passed(name: str) -> None:
    print(f"PASS {name} rank={RANK}", flush=True)


def shard_sizes() -> list[int]:
    """Uneven shards: rank 1 is empty (when there are 2+ ranks), others differ."""
    return [0 if (r == 1 and SIZE > 1) else 4 + 3 * r for r in range(SIZE)]


def make_replay(sampler, mode="decentralized", capacity=400, **kw) -> gm.Replay:
    return gm.Replay(SPEC, capacity, sampler, mode=mode, seed=7, timeout=30.0, force_alltoallv=FORCE, **kw)


def fill(replay: gm.Replay, n: int, seed: int) -> dict[int, tuple[dict, float]]:
    """Insert ``n`` trajectories on this rank; return {key: (data, priority)} of every rank's inserts."""
    rng = np.random.default_rng(1000 * seed + RANK)
    mine = {}
    for i in range(n):
        length = int(rng.integers(1, SPEC.max_length + 1))
        data = {"obs": rng.standard_normal((length, 3)).astype(np.float32),
                "step": np.arange(length, dtype=np.int64) + 100_000 * RANK + 1000 * i,
                "flag": rng.integers(0, 255, (length, 2)).astype(np.uint8)}
        prio = float(rng.uniform(0.1, 3.0))
        mine[replay.insert(data, priority=prio)] = (data, prio)
    allmaps = comm.allgather(mine)
    ref = {}
    for m in allmaps:
        ref.update(m)
    return ref


def check_windows(batch: gm.Batch, ref: dict, window: int, align: str) -> None:
    """Every row equals the window its key must contain; padding is zero; mask and lengths agree."""
    cols = batch.numpy()
    mask = batch.mask.numpy()
    for i, key in enumerate(batch.keys.numpy().tolist()):
        data, _ = ref[key]
        length = len(data["step"])
        n = min(length, window)
        assert batch.lengths[i].item() == n, (key, batch.lengths[i].item(), n)
        pad = window - n if (align == "tail" and length < window) else 0
        assert mask[i].tolist() == [pad <= t < pad + n for t in range(window)], (key, mask[i])
        got_steps = cols["step"][i, pad:pad + n]
        offset = int(got_steps[0] - data["step"][0])
        if align == "head":
            assert offset == 0
        elif align == "tail":
            assert offset == length - n
        assert 0 <= offset <= length - n
        for name in SPEC.names:
            np.testing.assert_array_equal(cols[name][i, pad:pad + n], data[name][offset:offset + n], err_msg=name)
            assert not cols[name][i, :pad].any() and not cols[name][i, pad + n:].any(), f"padding of {name}"


def scenario_exact() -> None:
    sizes = shard_sizes()
    selectors = [gm.Uniform(), gm.Prioritized(0.7, 0.5), gm.Fifo(), gm.Lifo(), gm.MaxPriority(), gm.MinPriority()]
    for mode in ("decentralized", "centralized"):
        for sel in selectors:
            replay = make_replay(sel, mode)
            ref = fill(replay, sizes[RANK], seed=1)
            live = len(ref)
            for align, window in (("random", 5), ("head", 12), ("tail", 7)):
                ask = 0 if RANK == SIZE - 1 and SIZE > 1 else 3 + RANK
                batch = replay.sample(ask, window, align)
                assert len(batch) == ask and batch["obs"].shape == (ask, window, 3)
                check_windows(batch, ref, window, align)
                rows = comm.allgather(list(zip(batch.keys.tolist(), batch.probabilities.tolist(),
                                               batch.weights.tolist())))
                flat = [r for part in rows for r in part]
                if sel.proportional:
                    w = {k: (1.0 if not sel.uses_importance_weights else p ** sel.alpha) for k, (_, p) in ref.items()}
                    total = sum(w.values())
                    for k, prob, weight in flat:
                        assert abs(prob - w[k] / total) < 1e-12, (k, prob, w[k] / total)
                        if sel.uses_importance_weights:
                            assert abs(weight - (min(w.values()) / w[k]) ** sel.beta) < 1e-6
                        else:
                            assert weight == 1.0
                else:
                    check_global_order(sel, ref, [k for k, _, _ in flat], rows)
            st = replay.stats()
            assert st["items"] == sizes and st["total_items"] == live, st
            if FORCE:
                assert st["total_windows_shared"] == 0, st
            replay.close()
            passed(f"exact/{mode}/{type(sel).__name__}")
    check_updates()
    check_transport()


def check_global_order(sel, ref: dict, picked: list[int], rows) -> None:
    """Ordered selectors: the batch over all ranks is the globally best items, dealt in rank order."""
    keys = list(ref)
    owner = {k: int(keyspace.decode(np.array([k]))[1][0]) for k in keys}
    if isinstance(sel, (gm.MaxPriority, gm.MinPriority)):
        sign = -1 if isinstance(sel, gm.MaxPriority) else 1
        # ties are impossible with random float priorities
        best = sorted(keys, key=lambda k: sign * ref[k][1])
    else:
        # insertion order within a shard is exact; across shards the stamps order them
        best = None
    btot = len(picked)
    if best is not None:
        # requester r gets the next B_r of the global order; its rows are grouped by owner rank
        expect = (best * (btot // max(len(best), 1) + 1))[:btot]
        start = 0
        for part in rows:
            got = [k for k, _, _ in part]
            assert sorted(got) == sorted(expect[start:start + len(got)]), (got, expect[start:start + len(got)])
            start += len(got)
    else:
        per_owner = {}
        for k in picked[:min(btot, len(keys))]:
            per_owner.setdefault(owner[k], []).append(k)
        for o, ks in per_owner.items():
            mine = [k for k in keys if owner[k] == o]  # ref keeps each rank's insertion order
            if isinstance(sel, gm.Lifo):
                mine = mine[::-1]
            assert ks == mine[:len(ks)], (o, ks, mine)
        assert len(set(picked[:min(btot, len(keys))])) == min(btot, len(keys))


def check_updates() -> None:
    replay = make_replay(gm.Prioritized(1.0, 0.4), capacity=60)
    ref = fill(replay, shard_sizes()[RANK], seed=2)
    batch = replay.sample(4, 4)
    new = np.arange(len(batch), dtype=np.float64) + 10.0 * (RANK + 1)
    applied = replay.update_priorities(batch.keys, new)
    # duplicates within and across ranks: the highest rank's last value wins
    sent = comm.allgather(list(zip(batch.keys.tolist(), new.tolist())))
    final = {}
    for part in sent:
        for k, p in part:
            final[k] = p
    assert applied == len(batch), (applied, len(batch))
    mine = [k for k in final if int(keyspace.decode(np.array([k]))[1][0]) == RANK]
    if mine:
        np.testing.assert_array_equal(replay.shard.priorities(mine), [final[k] for k in mine])
    # stale keys: overwrite the whole ring so every old key is evicted, then update them
    old = [k for k in ref if int(keyspace.decode(np.array([k]))[1][0]) == RANK]
    rng = np.random.default_rng(RANK)
    for _ in range(7):
        replay.insert({"obs": rng.random((12, 3)), "step": np.zeros(12, np.int64), "flag": np.zeros((12, 2), np.uint8)})
    everyone_old = [k for part in comm.allgather(old) for k in part]
    applied = replay.update_priorities(everyone_old if RANK == 0 else [], np.ones(len(everyone_old) if RANK == 0 else 0))
    assert applied == 0, applied
    st = replay.stats()
    assert st["total_stale_updates"] == len(everyone_old), st
    replay.close()
    passed("updates")


def check_transport() -> None:
    """Which path windows took: shared memory on a node, MPI when forced."""
    replay = make_replay(gm.Uniform())
    fill(replay, 5, seed=3)
    for _ in range(3):
        replay.sample(8, 4)
    st = replay.stats()
    if SIZE > 1:
        if FORCE:
            assert st["total_windows_shared"] == 0 and st["total_windows_mpi"] > 0, st
        else:
            assert st["total_windows_mpi"] == 0 and st["total_windows_shared"] > 0, st
    replay.close()
    passed("transport")


def chisquare_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare
    return float(chisquare(counts, probs * counts.sum()).pvalue)


def scenario_chisquare() -> None:
    sizes = shard_sizes()
    for mode in ("decentralized", "centralized"):
        for sel in (gm.Prioritized(0.8, 0.4), gm.Uniform()):
            replay = make_replay(sel, mode)
            ref = fill(replay, sizes[RANK], seed=4)
            drawn = []
            for _ in range(60):
                drawn.extend(replay.sample(40 + 10 * RANK, 1).keys.tolist())
            parts = comm.gather(drawn, root=0)
            if RANK == 0:
                everything = [k for part in parts for k in part]
                keys = sorted(ref)
                w = np.array([ref[k][1] ** sel.alpha if sel.proportional and hasattr(sel, "alpha") else 1.0
                              for k in keys])
                index = {k: i for i, k in enumerate(keys)}
                counts = np.bincount([index[k] for k in everything], minlength=len(keys))
                p = chisquare_p(counts, w / w.sum())
                # significance 1e-3 with fixed seeds: a wrong distribution fails by many orders of magnitude
                assert p > 1e-3, (mode, sel, p, counts)
                print(f"chisquare {mode} {type(sel).__name__} draws={counts.sum()} items={len(keys)} p={p:.3g}",
                      flush=True)
            replay.close()
            passed(f"chisquare/{mode}/{type(sel).__name__}")


def expect_same_error(fn, cls, what: str) -> None:
    try:
        fn()
    except cls as e:
        msgs = comm.allgather(str(e))
        assert len(set(msgs)) == 1, msgs
        assert what in msgs[0], (what, msgs[0])
        return
    raise AssertionError(f"expected {cls.__name__} on rank {RANK}")


def scenario_errors() -> None:
    replay = make_replay(gm.Prioritized(0.6, 0.4))
    expect_same_error(lambda: replay.sample(4, 3), gm.EmptyReplayError, "empty on every rank")
    ref = fill(replay, shard_sizes()[RANK], seed=5)
    bad = SIZE - 1
    expect_same_error(lambda: replay.sample(-1 if RANK == bad else 2, 3), ValueError, f"rank {bad}: batch_size")
    expect_same_error(lambda: replay.sample(2, 3 + (RANK == bad)), ValueError, "window and align")
    expect_same_error(lambda: replay.sample(2, 3, "middle" if RANK == bad else "head"), ValueError, "align")
    batch = replay.sample(2, 3)
    pr = np.ones(len(batch))
    if RANK == bad:
        pr[0] = np.nan
    expect_same_error(lambda: replay.update_priorities(batch.keys, pr), gm.InvalidPriorityError, "finite")
    if RANK == bad:
        pr[0] = -1.0
    expect_same_error(lambda: replay.update_priorities(batch.keys, pr), gm.InvalidPriorityError, "non-negative")
    other = make_replay(gm.Prioritized(0.6, 0.4))
    other_key = other.insert({"obs": np.zeros((2, 3)), "step": np.zeros(2, np.int64), "flag": np.zeros((2, 2), np.uint8)})
    if other.shard.tag == replay.shard.tag:
        other_key = int(other_key) ^ (1 << 62)  # same random tag (1 in 256): make it foreign anyway
    foreign = [other_key] if RANK == bad else []
    expect_same_error(lambda: replay.update_priorities(foreign, np.ones(len(foreign))), gm.InvalidKeyError,
                      "not issued by this replay")
    other.close()
    # nothing was changed by the failed calls, and the replay still works
    before = {k: p for k, (_, p) in ref.items() if int(keyspace.decode(np.array([k]))[1][0]) == RANK}
    if before:
        np.testing.assert_array_equal(replay.shard.priorities(list(before)), list(before.values()))
    batch = replay.sample(3, 4)
    assert len(batch) == 3
    replay.close()
    passed("errors")


def scenario_timeout() -> None:
    replay = gm.Replay(SPEC, 100, gm.Uniform(), seed=1, timeout=3.0, force_alltoallv=FORCE)
    fill(replay, 3, seed=6)
    late = SIZE - 1
    if RANK == late:
        time.sleep(8.0)  # never calls sample()
        print(f"PASS timeout-late rank={RANK}", flush=True)
    else:
        t0 = time.monotonic()
        try:
            replay.sample(2, 2)
        except gm.CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            assert 2.5 < took < 7.0, took
            assert "within timeout=3 s" in str(e), str(e)
            try:
                replay.sample(2, 2)
            except gm.CollectiveError as e2:
                assert "unusable" in str(e2)
            else:
                raise AssertionError("a broken replay accepted another collective")
            print(f"PASS timeout rank={RANK} after {took:.1f}s", flush=True)
        else:
            raise AssertionError("sample() returned although a rank never arrived")
    sys.stdout.flush()
    os._exit(0)  # pending requests would make MPI_Finalize wait for the late rank's collective


def scenario_fence() -> None:
    """The node fence: an owner's insert after a sample waits until every node peer has published
    that it finished reading that sample's windows; it raises CollectiveTimeoutError when one never does."""
    from gear_mpi.memory import reads_done_counter
    replay = gm.Replay(SPEC, 400, gm.Uniform(), seed=2, timeout=3.0)
    ref = fill(replay, 8, seed=9)
    mine = reads_done_counter(replay.shard.store.arena.buffer)
    batch = replay.sample(6, 4, "head")
    check_windows(batch, ref, 4, "head")
    assert int(mine[0]) == 1, f"sample 1 not published: {int(mine[0])}"
    # rank 1 pretends to be still reading sample 1 for 1.5 s; rank 0's insert must wait for it
    if RANK == 1:
        mine[0] = 0
    comm.Barrier()  # blocking: ranks wait here while rank 0 is held
    if RANK == 1:
        time.sleep(1.5)
        t_pub = time.time()
        mine[0] = 1
        replay.comm.comm.send(t_pub, dest=0)
    elif RANK == 0:
        replay.insert(ref[next(iter(ref))][0])
        t_ins = time.time()
        t_pub = replay.comm.comm.recv(source=1)
        assert t_ins >= t_pub, f"the insert went ahead {t_pub - t_ins:.3f} s before the peer published"
    comm.Barrier()  # blocking: ranks wait here while rank 0 is held
    # after another collective the fence is free: inserts do not wait
    replay.sample(2, 4, "head")
    t0 = time.monotonic()
    replay.insert(ref[next(iter(ref))][0])
    assert time.monotonic() - t0 < 0.5
    # a peer that never publishes: the owner's insert raises after the timeout
    replay.sample(2, 4, "head")
    if RANK == 1:
        mine[0] = 0
    comm.Barrier()  # blocking: ranks wait here while rank 0 is held
    if RANK == 0:
        t0 = time.monotonic()
        try:
            replay.insert(ref[next(iter(ref))][0])
        except gm.CollectiveTimeoutError as e:
            assert "node fence" in str(e) and 2.5 < time.monotonic() - t0 < 6.0, (str(e), time.monotonic() - t0)
        else:
            raise AssertionError("insert went ahead although a node peer never finished reading")
    comm.Barrier()  # blocking: ranks wait here while rank 0 is held
    if RANK == 1:
        mine[0] = replay._epoch
    replay.close()
    passed("fence")


def scenario_single() -> None:
    """Run without mpiexec: a 1-rank replay in every mode."""
    assert SIZE == 1
    for mode in ("decentralized", "centralized", "local"):
        replay = make_replay(gm.Prioritized(0.6, 0.4), mode)
        ref = fill(replay, 6, seed=8)
        batch = replay.sample(5, 6, "head")
        check_windows(batch, ref, 6, "head")
        assert replay.update_priorities(batch.keys, np.full(5, 2.0)) == 5
        replay.close()
        passed(f"single/{mode}")


if __name__ == "__main__":
    {"exact": scenario_exact, "chisquare": scenario_chisquare, "errors": scenario_errors,
     "timeout": scenario_timeout, "single": scenario_single, "fence": scenario_fence}[sys.argv[1]]()

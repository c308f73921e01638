"""A repeated decentralized ``Replay.sample(out=)`` (gear_mpi/distributed/repeat.py) under mpiexec
(tests/test_replay_repeat.py): the same batches as the full path, its errors, no reference to the batch.

Two replays of the same seed and contents on the same ranks: ``fast`` samples into one ``out=`` batch
(the first call records, the next ones repeat), ``full`` into a new batch each call (the full path). Every
call, both are compared bit for bit (columns, mask, lengths, probabilities, weights, and the keys but for
their per-replay tag), through priority updates, inserts that evict, uneven batch sizes, random
alignment, a change of window and a ``clear``. Then the errors: a window differing between ranks, an
empty replay, a rank in ``stats`` while the others repeat a sample -- each the same on every rank.
Prints ``PASS <check> rank=R``.
"""
import gc
import sys
import weakref

import numpy as np
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi.distributed import repeat

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
LOW = (1 << 55) - 1  # a key's slot, generation and rank (the tag above differs between replays)
spec = gm.TrajectorySpec({"obs": ((5,), np.float32), "act": ((), np.int16)}, max_length=12)

fast_calls = [0]
_again = repeat.sample_again


def counted(replay, rec):
    fast_calls[0] += 1
    return _again(replay, rec)


repeat.sample_again = counted


def trajectory(rng):
    n = int(rng.integers(1, 13))
    return {"obs": rng.standard_normal((n, 5)).astype(np.float32), "act": rng.integers(0, 99, n).astype(np.int16)}


def fill(replays, rng, n):
    trajs = [trajectory(rng) for _ in range(n)]
    prio = rng.uniform(0.1, 3.0, n)
    for rp in replays:
        rp.insert_many(trajs, prio)


def same(a, b, what):
    for name in ("obs", "act"):
        assert np.array_equal(a.numpy()[name], b.numpy()[name]), (what, name)
    ka, pa, wa, la = a.meta_numpy()
    kb, pb, wb, lb = b.meta_numpy()
    assert np.array_equal(ka & LOW, kb & LOW), what
    assert np.array_equal(pa, pb) and np.array_equal(wa, wb) and np.array_equal(la, lb), what
    assert np.array_equal(a._mask_np, b._mask_np), what


def check(name):
    comm.Barrier()
    print(f"PASS {name} rank={rank}", flush=True)


def repeats_again(replay, out, b, name):
    """After an error: the next call into ``out`` takes the repeated path again; then every rank passes ``name``."""
    before = fast_calls[0]
    replay.sample(b, 6, "head", out=out)
    assert fast_calls[0] == before + 1
    check(name)


for sampler in (gm.Prioritized(0.6, 0.4), gm.Uniform()):
    kind = type(sampler).__name__
    own = comm.Dup()  # the mismatch at the end leaves stats' payload pending on it: the next replays get another
    fast = gm.Replay(spec, 200, sampler, comm=own, seed=3, timeout=20)
    fresh = gm.Replay(spec, 200, sampler, comm=own, seed=3, timeout=20)  # new batches, repeated (a fresh record)
    full = gm.Replay(spec, 200, sampler, comm=own, seed=3, timeout=20)
    assert fast.node.board is not None, "the ranks must share one node"
    rng = np.random.default_rng(rank)
    fill([fast, fresh, full], rng, 10)
    b = 4 + rank  # uneven batch sizes
    out = None
    fast_calls[0] = 0
    earlier = []  # fresh's batches: a later call writes into none of them
    for step in range(40):
        window, align = (6, "head") if step < 15 else ((4, "random") if step < 30 else (6, "tail"))
        out = fast.sample(b, window, align, out=out if out is not None and out.window == window else None)
        new = fresh.sample(b, window, align)
        full._repeat.clear()  # the full path every call
        ref = full.sample(b, window, align)
        same(out, ref, (kind, step))
        same(new, ref, (kind, step, "fresh"))
        earlier.append((new, ref))
        if step % 3 == 0:  # new priorities for what was drawn (any rank's keys: routed)
            p = rng.uniform(0.1, 2.0, b)
            fast.update_priorities(out.keys, p)
            fresh.update_priorities(new.keys, p)
            full.update_priorities(ref.keys, p)
        if step % 7 == 0:  # inserts: the ring evicts, the masses change
            fill([fast, fresh, full], rng, 3)
    for new, ref in earlier:
        same(new, ref, (kind, "kept"))
    assert fast_calls[0] >= 60, fast_calls  # every call after the first of each window repeated, into out= or new
    for rp in (fast, fresh):  # a repeated record's kernels called through their entry points (kernels.compiled)
        settled = [rec.kernels for rec in rp._repeat.values() if rec.kernels.found[0]]  # (records made, not repeated)
        assert settled and all(all(k.found) for k in settled), [k.found for k in settled]
        assert not any(hasattr(run, "overloads") for k in settled for run in k.runs), "a dispatcher still called"
    shared = [rp.stats()["total"]["windows_shared"] for rp in (fast, fresh, full)]
    assert shared[0] == shared[1] == shared[2] > 0, shared
    fresh.close()
    check(f"same-batches-{kind}")

    # no reference to the batch kept: its count is what its holders make it, and a dropped batch is freed
    held = sys.getrefcount(out)
    fast.sample(b, 6, "tail", out=out)
    assert sys.getrefcount(out) == held
    gone = weakref.ref(out)
    ref = full.sample(b, 6, "tail")
    del out
    gc.collect()
    assert gone() is None
    check(f"no-reference-{kind}")

    # a window differing between ranks: the same ValueError on every rank, and the replay goes on
    out = fast.sample(b, 6, "head")
    fast.sample(b, 6, "head", out=out)
    try:
        fast.sample(b, 6, "head", out=out) if rank == 0 else fast.sample(b, 5, "head")
        raise SystemExit("FAIL: no error")
    except ValueError as e:
        msgs = comm.allgather(str(e))
        assert len(set(msgs)) == 1 and "window and align must be the same" in msgs[0], msgs
    repeats_again(fast, out, b, f"window-differs-{kind}")

    # an empty replay: EmptyReplayError on every rank from the repeated call; filled again, it repeats on
    fast.clear()
    try:
        fast.sample(b, 6, "head", out=out)
        raise SystemExit("FAIL: no error")
    except gm.EmptyReplayError as e:
        assert "empty" in str(e), str(e)
    fill([fast], rng, 4)
    repeats_again(fast, out, b, f"empty-{kind}")
    full.close()

    # another rank in another call: the same CollectiveError on every rank, then the replay is unusable
    try:
        fast.stats() if rank == 0 else fast.sample(b, 6, "head", out=out)
        raise SystemExit("FAIL: no error")
    except gm.CollectiveError as e:
        msgs = comm.allgather(str(e))
        assert len(set(msgs)) == 1 and "called stats" in msgs[0] and "called sample" in msgs[0], msgs
    try:
        fast.sample(b, 6, "head", out=out)
        raise SystemExit("FAIL: usable after a mismatch")
    except gm.CollectiveError:
        pass
    fast.close()
    check(f"mismatch-{kind}")

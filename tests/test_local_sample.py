"""The one-call sample and update of a shard's own host index (gear_mpi.kernels.local_sample) give what
the general path (select, make_choices, gather_from_owners, apply_priorities' old steps) gives: the same
rows, keys, probabilities, masks and data for the same seed, the same use counts and index afterwards."""
import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.kernels import local_sample
from gear_mpi.shard import Shard


def _fill(sh, n, maxlen, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, maxlen + 1, n)
    sh.insert_packed({"obs": rng.standard_normal((lengths.sum(), 3)).astype(np.float32),
                      "r": np.arange(lengths.sum(), dtype=np.int32)}, lengths, rng.random(n) + 0.1)


def _shard(sel, n=400, maxlen=5):
    """A shard whose ring has wrapped (windows that wrap, evicted items)."""
    spec = gm.TrajectorySpec({"obs": ((3,), "float32"), "r": ((), "int32")}, max_length=maxlen)
    sh = Shard(spec, 1500, sel, seed=5, tag=7, rank=3)
    _fill(sh, n, maxlen, 0)
    _fill(sh, n, maxlen, 1)
    return sh


def test_small_samples_run_on_the_calling_thread_alone(monkeypatch):
    """Where the threads would not pay (thread_share.caller_alone), the kernel runs with one thread and the
    calling thread's count comes back afterwards; the batch is the one the threads would give."""
    import numba
    from gear_mpi.kernels import gather, priority_draw, thread_share
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba's pool to hold 2 threads")
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        alone = thread_share.caller_alone
        low, high = priority_draw.DRAW_THREADS_MIN, thread_share.THREADS_MIN_ITEMS
        assert alone(low - 1, low) == 0 and alone(high, low) == 0 and alone(low, low, gather.COPY_THREADS_BYTES) == 0
        assert numba.get_num_threads() == 2
        assert alone(low, low, 4 * low) == 2 and numba.get_num_threads() == 1
        thread_share.give_back(2)
        assert numba.get_num_threads() == 2
        spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
        shards = [Shard(spec, 5000, gm.Prioritized(0.6, 0.4), seed=3, tag=7, rank=3) for _ in range(2)]
        for sh in shards:
            rng = np.random.default_rng(1)
            sh.insert_packed({"x": rng.random(5000, dtype=np.float32)}, np.ones(5000, np.int64), rng.random(5000) + 0.1)
        got = [shards[0].sample(low + 5, 1) for _ in range(2)]  # 2 threads asked: run alone, given back after
        assert numba.get_num_threads() == 2
        numba.set_num_threads(1)
        want = [shards[1].sample(low + 5, 1) for _ in range(2)]
        for g, w in zip(got, want):
            for a, b in ((g["x"], w["x"]), (g.keys, w.keys), (g.probabilities, w.probabilities),
                         (g.weights, w.weights)):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("sel", [gm.Prioritized(0.6, 0.4), gm.Uniform()], ids=["prioritized", "uniform"])
def test_one_call_copies_wide_rows_on_the_threads_as_the_general_path(sel):
    """A batch under DRAW_THREADS_MIN items whose rows pass COPY_THREADS_BYTES: drawn by the first thread into the
    copy's parallel region, copied in runs the threads take as they arrive (hints.take_next); the same batch as the
    general path's."""
    from gear_mpi.kernels import gather, priority_draw
    spec = gm.TrajectorySpec({"obs": ((256,), "float32"), "r": ((), "int32")}, max_length=3)
    shards = []
    for _ in range(2):
        sh = Shard(spec, 3000, sel, seed=5, tag=7, rank=3)
        rng = np.random.default_rng(0)
        for _ in range(2):  # the ring wraps
            lengths = rng.integers(1, 4, 800)
            sh.insert_packed({"obs": rng.standard_normal((lengths.sum(), 256)).astype(np.float32),
                              "r": np.arange(lengths.sum(), dtype=np.int32)}, lengths, rng.random(800) + 0.1)
        shards.append(sh)
    fast, slow = shards
    slow._fused = False
    b, window = 400, 3
    assert b < priority_draw.DRAW_THREADS_MIN and b * window * spec.step_bytes >= gather.COPY_THREADS_BYTES
    assert fast._one_call()
    for _ in range(3):
        bf, bs = fast.sample(b, window), slow.sample(b, window)
        for got, want in ((bf["obs"], bs["obs"]), (bf["r"], bs["r"]), (bf.mask, bs.mask), (bf.keys, bs.keys),
                          (bf.lengths, bs.lengths), (bf.probabilities, bs.probabilities)):
            np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("sel", [gm.Prioritized(0.6, 0.4), gm.Uniform()], ids=["prioritized", "uniform"])
@pytest.mark.parametrize("b", [1, 31, 32, 300, 4000])
def test_one_call_matches_the_general_path(sel, b, monkeypatch):
    for window, align in ((1, "random"), (3, "random"), (4, "head"), (5, "tail")):
        fast, slow = _shard(sel), _shard(sel)
        assert fast._one_call()
        slow._fused = False  # the general path
        for _ in range(2):
            bf, bs = fast.sample(b, window, align), slow.sample(b, window, align)
            for got, want in ((bf["obs"], bs["obs"]), (bf["r"], bs["r"]), (bf.mask, bs.mask), (bf.keys, bs.keys),
                              (bf.lengths, bs.lengths), (bf.probabilities, bs.probabilities)):
                np.testing.assert_array_equal(got.numpy(), want.numpy())
            np.testing.assert_array_equal(bf.weights.numpy(), bs.weights.numpy())  # the same ratio, the same power
            np.testing.assert_array_equal(fast.store.times_sampled, slow.store.times_sampled)
            new = np.random.default_rng(b).random(b) + 0.01
            assert fast.update_priorities(bf.keys, new) == slow.update_priorities(bs.keys, new)
            np.testing.assert_array_equal(fast.index.leaves, slow.index.leaves)
            np.testing.assert_array_equal(fast.priorities(bf.keys), slow.priorities(bs.keys))
        assert fast.stats() == slow.stats()


def test_one_call_only_where_it_applies(tmp_path):
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    assert Shard(spec, 10, gm.Prioritized())._one_call()
    assert not Shard(spec, 10, gm.Prioritized(), max_times_sampled=2)._one_call()
    assert not Shard(spec, 10, gm.Fifo())._one_call()
    assert not Shard(spec, 10, gm.Uniform(), memory="file", path=tmp_path)._one_call()
    # a large batch from a small shard (tree and table in cache) takes the one call too
    small = Shard(spec, 1000, gm.Prioritized(), seed=1)
    small.insert_packed({"x": np.zeros(1000, np.float32)}, np.ones(1000, np.int64), np.ones(1000))
    small.sample(4 * local_sample.DRAW_THREADS_MIN, 1)
    assert small._repeat is not None  # one_call.remember: only the one-call path keeps a record


def test_update_with_stale_and_foreign_keys():
    sh = _shard(gm.Prioritized(1.0, 1.0))
    b = sh.sample(20, 1)
    keys = b.keys.numpy().copy()
    with pytest.raises(gm.InvalidKeyError):
        sh.update_priorities(np.concatenate([keys, [keys[0] ^ (1 << 62)]]), np.ones(21))
    assert sh.stale_updates == 0 and np.isclose(sh.priorities(keys), sh.store.priority[keys & ((1 << 27) - 1)]).all()
    for seed in range(4):  # evicts every item sampled above
        _fill(sh, 300, 5, 10 + seed)
    assert sh.update_priorities(keys, np.full(20, 2.0)) == 0 and sh.stale_updates == 20


def test_scratch_is_kept_per_thread_and_updates_reuse_theirs():
    """The one-call sample's scratch is kept between calls of a thread (no fresh pages to fault in), never
    shared between threads; an index's update scratch is kept too, and reusing it changes no result."""
    import threading

    from gear_mpi.kernels import priority_tree
    from gear_mpi.selection import PriorityIndex

    flat = local_sample._scratch(600)  # (one allocation of staggered rows: int64, and its float64 view)
    assert local_sample._scratch(600) is flat
    small = local_sample._scratch(100)
    assert np.shares_memory(small[0], flat[0]) and np.shares_memory(small[1], small[0])
    assert small[0].dtype == np.int64 and small[1].dtype == np.float64 and small[0].flags.c_contiguous
    other = []
    t = threading.Thread(target=lambda: other.append(local_sample._scratch(600)))
    t.start()
    t.join()
    assert not np.shares_memory(other[0][0], flat[0])
    rng = np.random.default_rng(4)
    kept, fresh = PriorityIndex(50_000), PriorityIndex(50_000)
    for b in (4000, 700, 4000, 3000):
        slots, values = rng.integers(0, 50_000, b), rng.random(b)
        kept.set(slots, values)
        priority_tree.set_leaves(fresh._arrays, fresh._flags1, fresh._flags2, slots, values)
    assert kept._scratch_f.shape[0] == 4000
    # staggered rows: entry k of each row in a different cache set (rows of 2**16 entries, as W3's B)
    big = local_sample._scratch(1 << 16)
    stride = big[0].shape[0] // local_sample.SCRATCH_ROWS
    rows = [big[0][r * stride:r * stride + (1 << 16)] for r in range(local_sample.SCRATCH_ROWS)]
    assert len({int(r.ctypes.data) % 4096 // 64 for r in rows}) == local_sample.SCRATCH_ROWS
    assert stride >= 1 << 16 and all(r.flags.c_contiguous and len(r) == 1 << 16 for r in rows)
    ints, floats = PriorityIndex(10)._set_scratch(1 << 16)
    assert len({int(a.ctypes.data) % 4096 // 64 for a in (ints[0], ints[1], floats)}) == 3
    assert floats.dtype == np.float64 and ints.dtype == np.int64 and ints[1].flags.c_contiguous
    for a, b in zip(kept.tree, fresh.tree):
        np.testing.assert_array_equal(a, b)
    priority_tree.rebuild(fresh._arrays)
    for a, b in zip(kept.tree, fresh.tree):
        np.testing.assert_array_equal(a, b)

"""The one-call sample's parallel paths (issue 34, round 4): the uniforms bucketed by the threads and each draw run
sorting its own buckets (``local_sample.SORT_PARALLEL_MIN``), the uniforms drawn by the kernel's threads from
the shard's PCG64 state (``gear_mpi.kernels.pcg_fill``), placement uniforms that no window reads skipped in
the stream (``one_call.placement_unread``), small batches around the thresholds. Each gives what the general
path gives, bit for bit, on one thread and two."""
import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.kernels import local_sample, priority_draw
from gear_mpi.selection import one_call
from gear_mpi.shard import Shard

SORT_MIN = local_sample.SORT_PARALLEL_MIN


def _pair(n, cap, maxlen, row=3, seed=5):
    """Two shards filled alike (a wrapped ring when ``n`` is large): the one-call path and the general one."""
    spec = gm.TrajectorySpec({"obs": ((row,), "uint8"), "r": ((), "int32")}, max_length=maxlen)
    out = []
    for _ in range(2):
        sh = Shard(spec, cap, gm.Prioritized(0.6, 0.4), seed=seed, tag=7, rank=3)
        rng = np.random.default_rng(0)
        for _ in range(2):
            lengths = rng.integers(1, maxlen + 1, n)
            sh.insert_packed({"obs": rng.integers(0, 255, (lengths.sum(), row), dtype=np.uint8),
                              "r": np.arange(lengths.sum(), dtype=np.int32)}, lengths, rng.random(n) + 0.1)
        out.append(sh)
    fast, slow = out
    assert fast._one_call()
    slow._fused = False
    return fast, slow


def _same(bf, bs, fast, slow):
    for name in ("obs", "r"):
        np.testing.assert_array_equal(bf[name].numpy(), bs[name].numpy())
    for got, want in ((bf.mask, bs.mask), (bf.keys, bs.keys), (bf.lengths, bs.lengths),
                      (bf.probabilities, bs.probabilities), (bf.weights, bs.weights)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert fast.rng.bit_generator.state == slow.rng.bit_generator.state


@pytest.mark.parametrize("b", [SORT_MIN - 1, SORT_MIN, SORT_MIN + 1, 3 * SORT_MIN + 17])
def test_parallel_bucket_pass_is_the_serial_sort(b, threads, monkeypatch):
    """At and around SORT_PARALLEL_MIN: the sorted draw the sample leaves (order of the uniforms) is the serial
    counting sort's, and the batch, the stream and the update that follows are the general path's."""
    fast, slow = _pair(6000, 20_000, 4)
    for window, align in ((1, "random"), (2, "head"), (4, "random")):
        state = fast.rng.bit_generator.state
        bf, bs = fast.sample(b, window, align), slow.sample(b, window, align)
        _same(bf, bs, fast, slow)
        sslots, order, inv = (r.copy() for r in local_sample.sorted_draw(b))
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state
        want_order, want_keys = priority_draw._sort_order(rng.random(b))
        np.testing.assert_array_equal(order, want_order)
        np.testing.assert_array_equal(inv[order], np.arange(b))
        assert (np.diff(sslots) >= 0).all()
        np.testing.assert_array_equal(sslots, bf.keys.numpy()[order] & ((1 << 27) - 1))
        new = np.random.default_rng(b).random(b) + 0.01
        assert fast.update_priorities(bf.keys, new) == slow.update_priorities(bs.keys, new)
        np.testing.assert_array_equal(fast.index.leaves, slow.index.leaves)
        for a, w in zip(fast.index.tree, slow.index.tree):
            np.testing.assert_array_equal(a, w)


def test_crowded_buckets_stay_exact(threads):
    """Uniforms crowded into a few buckets (the insertion sort's 64-place limit leaves them partly unsorted):
    the parallel pass and each run's sort give the serial result, and every draw is draw_one's."""
    fast, _ = _pair(3000, 10_000, 1)
    b = 2 * SORT_MIN
    rng = np.random.default_rng(3)
    u = np.concatenate([rng.random(b // 2) * 1e-4, rng.random(b - b // 2)])
    rng.shuffle(u)
    st, idx = fast.store, fast.index
    batch = fast.sample(b, 1)
    keys, probabilities, weights, lengths = batch.meta_numpy()
    local_sample.sample_proportional(idx._arrays, u, np.zeros(b), st.start, st.length, st.status, 0, 27,
                                     (1 << 20) - 1, st.capacity, 1, 1, True, fast.column_addresses()[0],
                                     fast.spec.step_bytes_array, batch.column_addresses(), batch._mask_np, keys,
                                     lengths, probabilities, weights)
    sslots, order, _ = local_sample.sorted_draw(b)
    want_order, _ = priority_draw._sort_order(u)
    np.testing.assert_array_equal(order, want_order)
    want = np.empty(b, np.int64)
    priority_draw.draw(idx._arrays, u, want)
    np.testing.assert_array_equal(keys & ((1 << 27) - 1), want)


@pytest.mark.parametrize("b", [2 * priority_draw.DRAW_PIPE - 1, 2 * priority_draw.DRAW_PIPE,
                               2 * priority_draw.DRAW_PIPE + 1, 255, 256, priority_draw.DRAW_THREADS_MIN - 1,
                               priority_draw.DRAW_THREADS_MIN])
def test_small_batches_with_a_shared_copy(b, threads):
    """4 KiB rows (a shared copy from 256 rows): around 2 * DRAW_PIPE, COPY_THREADS_BYTES and DRAW_THREADS_MIN
    (where the threads draw too), the same batch, stream and update as the general path, into a kept ``out=``
    batch as well."""
    fast, slow = _pair(300, 900, 1, row=4096)
    rows = b * 4100
    assert (rows >= local_sample.COPY_THREADS_BYTES) == (b >= 256)
    out = fast.sample(b, 1)
    slow.sample(b, 1)
    for _ in range(3):
        bf, bs = fast.sample(b, 1, out=out), slow.sample(b, 1)
        _same(bf, bs, fast, slow)
        new = np.random.default_rng(b).random(b) + 0.01
        assert fast.update_priorities(bf.keys, new) == slow.update_priorities(bs.keys, new)
        np.testing.assert_array_equal(fast.index.leaves, slow.index.leaves)


def test_unread_placement_uniforms_are_skipped_in_the_stream(monkeypatch):
    """Trajectories that fit the window: the placement uniforms are not drawn but stepped over (the same stream
    state after the call, the same batch); not where a trajectory is longer than the window, nor when a 32-bit
    half is buffered in the generator or its slot holds one used (``advance`` would clear them), nor below
    SKIP_MIN."""
    b = one_call.SKIP_MIN
    fast, slow = _pair(3000, 10_000, 2)
    assert one_call.placement_unread(fast, b, 2, 0) and not one_call.placement_unread(fast, b, 1, 0)
    assert not one_call.placement_unread(fast, b - 1, 2, 0) and not one_call.placement_unread(fast, b, 2, 1)
    out = fast.sample(b, 2)
    slow.sample(b, 2)
    for k in range(5):
        if k in (2, 4):  # a 32-bit half buffered in the generator (k = 2), then used up (its slot stays set)
            for sh in (fast, slow):
                sh.rng.integers(0, 10, dtype=np.uint32)
            assert fast.rng.bit_generator.state["has_uint32"] == (k == 2)
            assert fast.rng.bit_generator.state["uinteger"]
        rep = fast._repeat  # None at first: the first call into ``out`` takes the full path
        if rep is not None:
            rep.place_u[:] = -1.0  # left as it is where the uniforms are skipped
        bf, bs = fast.sample(b, 2, out=out), slow.sample(b, 2)
        _same(bf, bs, fast, slow)
        assert fast._repeat.skip and (fast._repeat.place_u == -1.0).all() == (k == 1)
    bf, bs = fast.sample(b, 1), slow.sample(b, 1)  # trajectories of 2 steps, windows of 1: the uniforms are read
    _same(bf, bs, fast, slow)


@pytest.mark.parametrize("n, skip", [(2 * 8192, 0), (65536 + 3, 65536), (40_001, 7)])
def test_pcg_fill_is_numpy_random(n, skip, threads):
    """pcg_fill.fill: the doubles of ``Generator(PCG64).random``, bit for bit, and the generator's state
    afterwards (a buffered 32-bit half kept as it was); too few values or another bit generator: not filled."""
    from gear_mpi.kernels import pcg_fill
    for seed in (0, 12345):
        a, b = (np.random.Generator(np.random.PCG64(seed)) for _ in range(2))
        for g in (a, b):
            g.random(3)
            g.integers(0, 10, dtype=np.uint32)  # a 32-bit half buffered
        out = np.empty(n)
        assert pcg_fill.fill(a, out, skip)
        want = b.random(n)
        b.random(skip)
        np.testing.assert_array_equal(out.view(np.uint64), want.view(np.uint64))
        assert a.bit_generator.state == b.bit_generator.state
        np.testing.assert_array_equal(a.integers(0, 1 << 30, 5, dtype=np.uint32),
                                      b.integers(0, 1 << 30, 5, dtype=np.uint32))
    assert not pcg_fill.fill(np.random.default_rng(0), np.empty(2 * pcg_fill.SLICE - 1))
    assert not pcg_fill.fill(np.random.Generator(np.random.MT19937(0)), np.empty(4 * pcg_fill.SLICE))


def test_kernel_draws_the_uniforms_with_a_buffered_half(monkeypatch):
    """From SORT_PARALLEL_MIN the kernel draws the uniforms itself (placements unread): the same batch and
    stream as the general path, a buffered 32-bit half included; where placements are read, numpy draws."""
    b = SORT_MIN + 5
    fast, slow = _pair(6000, 20_000, 2)
    for sh in (fast, slow):
        sh.rng.integers(0, 10, dtype=np.uint32)
    assert one_call.kernel_stream(fast.rng, b, 0, True)[1] is not None
    assert one_call.kernel_stream(fast.rng, b, 0, False)[1] is None
    assert one_call.kernel_stream(fast.rng, SORT_MIN - 1, 1, False)[1] is None
    out = fast.sample(b, 2)
    _same(out, slow.sample(b, 2), fast, slow)
    for window in (2, 2, 1, 3):
        bf, bs = fast.sample(b, window, out=out) if window == 2 else fast.sample(b, window), slow.sample(b, window)
        _same(bf, bs, fast, slow)
    assert fast.rng.bit_generator.state["has_uint32"]


@pytest.mark.parametrize("b", [priority_draw.DRAW_THREADS_MIN, SORT_MIN + 1])
def test_one_step_rows_written_in_row_order(b, threads, monkeypatch):
    """A one-step spec (max_length 1): the runs write every batch row's real steps and mask in row order, the
    same for every item (``local_sample._fill_fixed_rows``); the batch, into a new batch and a kept ``out=``, is
    the general path's for windows that fit and windows padded at the end or the front."""
    fast, slow = _pair(3000, 10_000, 1)
    seen = []
    real = local_sample._sample_kernel
    at = real.py_func.__code__.co_varnames.index("one_step")
    monkeypatch.setattr(local_sample, "_sample_kernel", lambda *a: seen.append(a[at]) or real(*a))
    for window, align in ((1, "random"), (1, "tail"), (3, "head"), (3, "tail"), (2, "random")):
        out = fast.sample(b, window, align)
        _same(out, slow.sample(b, window, align), fast, slow)
        out.mask.numpy()[:] = ~out.mask.numpy()  # rows the next call must write again
        out.lengths.numpy()[:] = 7
        for _ in range(2):
            _same(fast.sample(b, window, align, out=out), slow.sample(b, window, align), fast, slow)
    assert seen and all(flag is True for flag in seen)  # the one-step rows, every call

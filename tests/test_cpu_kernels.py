"""The numba CPU kernels against plain numpy references: the blocked priority structure
(draws, batched updates, min tracking), window gathering (with wrap-around), window
placement and masks, and the ring/table bookkeeping (driven through a Shard)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import numba
from numba import njit, prange

import gear_mpi as gm
from gear_mpi import keys as keyspace
from gear_mpi.kernels import gather, hints, priority_draw, priority_tree as tree, ring
from gear_mpi.selection import PriorityIndex


# ---- priority tree ------------------------------------------------------------------------------

def reference_draw(leaves: np.ndarray, total: float, uniforms: np.ndarray) -> np.ndarray:
    """First leaf whose inclusive running sum exceeds u * total (the last positive leaf past the end)."""
    cum = np.cumsum(leaves)
    idx = np.searchsorted(cum, uniforms * total, side="right")
    last_positive = int(np.flatnonzero(leaves > 0)[-1])
    return np.minimum(idx, last_positive)


def loaded_index(weights: np.ndarray) -> PriorityIndex:
    index = PriorityIndex(len(weights))
    index.set(np.arange(len(weights), dtype=np.int64), weights)
    return index


def kernel_draw(index: PriorityIndex, uniforms: np.ndarray) -> np.ndarray:
    out = np.full(len(uniforms), -7, np.int64)
    priority_draw.draw(index.tree, uniforms, out)
    return out


def sparse_weights(n: int, rng, integer: bool) -> np.ndarray:
    w = rng.integers(1, 1000, n).astype(np.float64) if integer else rng.uniform(0.0, 1.0, n) ** 3
    w[rng.random(n) < 0.3] = 0.0             # scattered zeros
    if n > 3 * tree.FANOUT:
        w[tree.FANOUT:3 * tree.FANOUT] = 0.0      # whole empty level-1 blocks
    if n > 3 * tree.FANOUT2:
        w[tree.FANOUT2:2 * tree.FANOUT2] = 0.0    # a whole empty level-2 block
    w[0] = 0.0                                    # leading and trailing zeros
    w[-1] = 0.0
    return w


@pytest.mark.parametrize("n", [2, 63, 64, 65, 4096, 4097, 20_000, 300_000])
@pytest.mark.parametrize("batch", [1, 100, 2048, 2049, 30_000])
def test_draw_matches_searchsorted_on_integer_weights(n, batch):
    """Integer weights make every partial sum exact, so the kernel and the reference must agree exactly."""
    rng = np.random.default_rng(n * 7 + batch)
    w = sparse_weights(n, rng, integer=True)
    if not (w > 0).any():
        w[n // 2] = 3.0
    index = loaded_index(w)
    assert index.total == w.sum()
    u = rng.random(batch)
    u[0] = 0.0
    if batch > 1:
        u[1] = np.nextafter(1.0, 0.0)
    got = kernel_draw(index, u)
    np.testing.assert_array_equal(got, reference_draw(w, index.total, u))
    assert (w[got] > 0).all()
    np.testing.assert_array_equal(index.draw(u), got)


@pytest.mark.parametrize("n, batch", [(1000, 500), (50_000, 3000), (300_000, 40_000)])
def test_draw_matches_searchsorted_on_float_weights(n, batch):
    rng = np.random.default_rng(n + batch)
    w = tree.leaf_values(sparse_weights(n, rng, integer=False))  # float32 values: the leaves hold them exactly
    index = loaded_index(w)
    assert index.total == pytest.approx(w.sum(), rel=1e-12)
    u = rng.random(batch)
    got = kernel_draw(index, u)
    np.testing.assert_array_equal(got, reference_draw(w, index.total, u))


@pytest.mark.parametrize("batch", [50, 5000])
def test_draw_at_exact_block_boundaries(batch):
    """Integer weights summing to a power of two: u = cumsum[k] / total is exact, and a draw that
    lands exactly on the end of leaf k's mass must pick the next positive leaf (as searchsorted 'right')."""
    rng = np.random.default_rng(batch)
    n = 20_000
    w = sparse_weights(n, rng, integer=True)
    last = int(np.flatnonzero(w > 0)[-1])
    w[last] += 2.0 ** 24 - w.sum()
    assert w[last] > 0 and w.sum() == 2.0 ** 24
    index = loaded_index(w)
    assert index.total == 2.0 ** 24
    cum = np.cumsum(w)
    edges = np.unique(cum[(cum > 0) & (cum < cum[-1])])
    u = rng.choice(edges, batch) / index.total
    u[: len(edges[:batch // 2])] = edges[:batch // 2] / index.total  # block starts near the front too
    u = np.concatenate([u, np.nextafter(u, 0.0), np.nextafter(u, 1.0)])
    got = kernel_draw(index, u)
    np.testing.assert_array_equal(got, reference_draw(w, index.total, u))
    assert (w[got] > 0).all()


@njit
def _both_scans(sums, lo, hi, rs, out):
    for i in range(rs.shape[0]):
        a, ra = priority_draw._scan(sums, lo, hi, rs[i])
        b, rb = priority_draw._scan_line(sums, lo, hi, rs[i])
        out[i, 0], out[i, 1], out[i, 2], out[i, 3] = a, b, ra, rb


def test_branch_free_line_scan_is_the_plain_scan():
    """The draw's line scans (no data-dependent exit) stop at the same entry with the same remainder as
    ``_scan``: lines with zeros, values too small to move the running sum, all-zero and short lines,
    ``r`` on every running sum exactly, just below and above it, and past the end."""
    rng = np.random.default_rng(11)
    for case in range(300):
        width = tree.LINE if case % 3 else int(rng.integers(1, tree.LINE + 1))
        sums = rng.integers(0, 5, width).astype(np.float64) * rng.choice([1.0, 0.1, 1e-17], width)
        if case % 7 == 0:
            sums[:] = 0.0
        if case % 11 == 0:
            sums[0] = 1e20  # later entries vanish into the running sum
        cum = np.cumsum(sums)
        rs = np.concatenate([[0.0], cum, np.nextafter(cum, 0.0), np.nextafter(cum, np.inf), cum[-1:] * 2,
                             rng.random(8) * max(cum[-1], 1e-300)])
        rs = np.abs(rs)
        out = np.zeros((len(rs), 4))
        _both_scans(sums, 0, width, rs, out)
        np.testing.assert_array_equal(out[:, 0], out[:, 1])
        np.testing.assert_array_equal(out[:, 2], out[:, 3])


def test_galloping_top_search_is_the_binary_search():
    """The level-2 search from a guess (the previous sorted draw's block) finds the same block as the search
    without one: prefix sums with runs of empty blocks (repeated values), targets on every prefix value
    exactly, just below and above it and past the total, guesses at the answer, below it by 1 to n2, above
    it (not a valid guess) and none."""
    rng = np.random.default_rng(12)
    for case in range(40):
        n2 = int(rng.integers(1, 700))
        l2 = rng.integers(1, 9, n2).astype(np.float64)
        for _ in range(int(rng.integers(0, 4))):  # runs of empty blocks
            a = int(rng.integers(0, n2))
            l2[a:a + int(rng.integers(1, 40))] = 0.0
        if case % 5 == 0:
            l2[0] = 0.0
            l2[-1] = 0.0
        if not (l2 > 0).any():
            l2[n2 // 2] = 1.0
        prefix = np.concatenate([[0.0], np.cumsum(l2)])
        targets = np.concatenate([prefix, np.nextafter(prefix, -1.0), np.nextafter(prefix, np.inf),
                                  rng.random(50) * prefix[-1]])
        for target in targets[targets >= 0.0]:
            want = priority_draw._top_block(l2, prefix, target, n2, -1)
            below = np.unique(np.clip(want[0] - np.array([0, 1, 2, 3, 7, 64, 1000, n2]), 0, n2 - 1))
            for guess in np.concatenate([below, [min(want[0] + 1, n2 - 1), n2 - 1]]):
                got = priority_draw._top_block(l2, prefix, target, n2, int(guess))
                assert got == want, (case, target, guess)


@pytest.mark.parametrize("batch", [40, 700, 5000])
def test_sorted_draws_far_apart_over_many_level2_blocks(batch):
    """Draws over some 500 level-2 blocks, with long runs of empty blocks, where consecutive sorted draws
    skip from one to hundreds of blocks (the galloping search's long steps): the reference's leaves, and
    draw_one's (batches under DRAW_PIPE draw one by one)."""
    rng = np.random.default_rng(batch)
    n = 500 * tree.FANOUT2 + 123
    w = rng.integers(0, 1000, n).astype(np.float64)
    w[20 * tree.FANOUT2:90 * tree.FANOUT2 + 5] = 0.0  # 70 empty blocks
    w[300 * tree.FANOUT2 - 7:301 * tree.FANOUT2] = 0.0
    w[-3 * tree.FANOUT2:] = 0.0
    index = loaded_index(w)
    u = rng.random(batch)
    u[:2] = [0.0, np.nextafter(1.0, 0.0)]
    got = kernel_draw(index, u)
    np.testing.assert_array_equal(got, reference_draw(w, index.total, u))
    one = np.concatenate([kernel_draw(index, u[i:i + 20]) for i in range(0, min(batch, 200), 20)])  # draw_one's
    np.testing.assert_array_equal(got[:len(one)], one)


def test_draw_order_of_uniforms_does_not_matter():
    """Batched draws may sort the uniforms internally; the result must follow the caller's order."""
    rng = np.random.default_rng(3)
    w = sparse_weights(100_000, rng, integer=True)
    index = loaded_index(w)
    u = rng.random(10_000)
    u[:100] = np.sort(u[:100])[::-1]  # a descending run, then random
    got = kernel_draw(index, u)
    perm = rng.permutation(len(u))
    np.testing.assert_array_equal(kernel_draw(index, u[perm]), got[perm])
    np.testing.assert_array_equal(got, reference_draw(w, index.total, u))
    same = np.full(5000, 0.37)  # many equal uniforms
    assert set(kernel_draw(index, same).tolist()) == set(reference_draw(w, index.total, same[:1]).tolist())


def test_draw_after_updates_matches_reference():
    rng = np.random.default_rng(4)
    n = 50_000
    w = sparse_weights(n, rng, integer=True)
    index = loaded_index(w)
    for batch in (10, 3000):
        slots = rng.integers(0, n, batch)
        vals = rng.integers(0, 50, batch).astype(np.float64)
        index.set(slots, vals)
        for s, v in zip(slots, vals):  # sequential semantics: the last duplicate wins
            w[s] = v
        np.testing.assert_array_equal(index.leaves, w)
        u = rng.random(5000)
        np.testing.assert_array_equal(kernel_draw(index, u), reference_draw(w, index.total, u))


def check_levels(index: PriorityIndex) -> None:
    """Every level agrees with the leaves (sums to 1e-12, minima exactly) and with a full rebuild."""
    n = len(index.leaves)
    f, f2 = tree.FANOUT, tree.FANOUT2
    pad = -n % f2
    leaves = np.concatenate([index.leaves, np.zeros(pad)])
    lines = leaves.reshape(-1, tree.LINE)[: len(index.l0_sum)]
    np.testing.assert_allclose(index.l0_sum, lines.sum(1), rtol=1e-12, atol=0)
    blocks1 = leaves.reshape(-1, f)[: len(index.l1_sum)]
    np.testing.assert_allclose(index.l1_sum, blocks1.sum(1), rtol=1e-12, atol=0)
    pos1 = np.where(blocks1 > 0, blocks1, np.inf)
    np.testing.assert_array_equal(index.l1_min, pos1.min(1))
    blocks2 = leaves.reshape(-1, f2)
    np.testing.assert_allclose(index.l2_sum, blocks2.sum(1), rtol=1e-12, atol=0)
    np.testing.assert_array_equal(index.l2_min, np.where(blocks2 > 0, blocks2, np.inf).min(1))
    np.testing.assert_allclose(index.prefix, np.concatenate([[0.0], np.cumsum(index.l2_sum)]), rtol=1e-12)
    assert index.total == pytest.approx(index.leaves.sum(dtype=np.float64), rel=1e-12)
    positive = index.leaves[index.leaves > 0]
    assert index.min_positive == (positive.min() if len(positive) else np.inf)
    fresh = PriorityIndex(n)
    fresh.leaves[:] = index.leaves
    fresh.rebuild()
    for name in ("l0_sum", "l1_sum", "l1_min", "l2_sum", "l2_min", "prefix"):
        assert getattr(fresh, name).tobytes() == getattr(index, name).tobytes(), name
    assert not index._flags1.any() and not index._flags2.any(), "scratch flags must be returned zeroed"


@pytest.mark.parametrize("n", [1, 100, 9000, 70_000])
def test_set_leaves_duplicates_last_wins_and_levels_stay_exact(n):
    rng = np.random.default_rng(n)
    index = PriorityIndex(n)
    want = np.zeros(n)
    check_levels(index)
    for batch in (1, 7, 500, 2048, 2049, 6000):
        slots = rng.integers(0, n, batch)
        slots[-1] = slots[0]  # at least one duplicate
        vals = rng.uniform(0, 10, batch)
        vals[rng.random(batch) < 0.2] = 0.0
        vals = tree.leaf_values(vals)  # float32 values (others are held rounded: test_compact_bookkeeping)
        # raw kernel call, as PriorityIndex.set makes it
        tree.set_leaves(index.tree, index._flags1, index._flags2, slots.astype(np.int64), vals)
        for s, v in zip(slots, vals):
            want[s] = v
        assert index.leaves[slots[0]] == vals[-1]
        np.testing.assert_array_equal(index.leaves, want)
        check_levels(index)


def test_min_tracking():
    n = 10_000
    index = PriorityIndex(n)
    assert index.min_positive == np.inf and index.total == 0.0
    index.set(np.array([5, 4200, 9999]), np.array([3.0, 0.25, 7.0]))
    assert index.min_positive == 0.25
    index.set(np.array([4200]), np.array([0.0]))  # removing the minimum exposes the next one
    assert index.min_positive == 3.0
    index.set(np.array([9998, 9998]), np.array([0.001, 2.0]))  # the last duplicate wins
    assert index.min_positive == 2.0
    index.set(np.array([5, 9999, 9998]), np.zeros(3))
    assert index.min_positive == np.inf and index.total == 0.0
    check_levels(index)


def test_level_sizes():
    assert [tree.line_count(n) for n in (1, 8, 9, 64, 65)] == [1, 1, 2, 8, 9]
    assert tree.level_sizes(1) == (1, 1)
    assert tree.level_sizes(64) == (1, 1)
    assert tree.level_sizes(65) == (2, 1)
    assert tree.level_sizes(4096) == (64, 1)
    assert tree.level_sizes(4097) == (65, 2)


# ---- gather ---------------------------------------------------------------------------------------

def reference_gather(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window):
    steps = src.reshape(capacity, step_bytes)
    rows = out.reshape(-1, window * step_bytes)
    for s, nv, pf, r in zip(starts, n_valid, pad_front, out_rows):
        row = np.zeros(window * step_bytes, np.uint8)
        idx = (s + np.arange(nv)) % capacity
        row[pf * step_bytes:(pf + nv) * step_bytes] = steps[idx].reshape(-1)
        rows[r] = row


@pytest.mark.parametrize("step_bytes, capacity, window, b", [
    (1, 50, 7, 200), (5, 97, 16, 200), (42, 31, 31, 200), (8, 1000, 64, 200),
    (42, 500, 64, 400),  # over gather.COPY_THREADS_BYTES (1 MiB): the kernel's parallel path
])
def test_gather_windows_matches_numpy_with_wrap(step_bytes, capacity, window, b):
    rng = np.random.default_rng(step_bytes * capacity)
    src = rng.integers(0, 256, capacity * step_bytes).astype(np.uint8)
    rows_total = b + 30
    n_valid = rng.integers(0, window + 1, b)
    pad_front = np.array([rng.integers(0, window - nv + 1) for nv in n_valid])
    starts = rng.integers(0, capacity, b)
    starts[:20] = capacity - rng.integers(1, window + 1, 20)  # close to the end: these wrap
    n_valid[:20] = window
    pad_front[:20] = 0
    n_valid = np.minimum(n_valid, capacity)
    out_rows = rng.permutation(rows_total)[:b].astype(np.int64)
    out = np.full(rows_total * window * step_bytes, 0xAB, np.uint8)  # not zero: padding must be written
    want = out.copy()
    gather.gather_windows(src, capacity, step_bytes, starts.astype(np.int64), n_valid.astype(np.int64),
                          pad_front.astype(np.int64), out_rows, out, window)
    reference_gather(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, want, window)
    assert ((starts + n_valid) > capacity).sum() >= 10, "the test must exercise wrap-around"
    np.testing.assert_array_equal(out, want)
    untouched = np.setdiff1d(np.arange(rows_total), out_rows)
    assert (out.reshape(rows_total, -1)[untouched] == 0xAB).all(), "rows not asked for were written"


def test_index_set_and_draw_of_mid_size_batches_run_alone_and_give_the_count_back():
    """PriorityIndex.set and .draw of 1000 items (where the threads do not pay: kernels.thread_share) leave the
    calling thread's numba count as it was and the same tree and draws as with one thread."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba's pool to hold 2 threads")
    before = numba.get_num_threads()
    rng = np.random.default_rng(9)
    weights = rng.random(50_000) + 0.1
    slots, values, u = rng.integers(0, 50_000, 1000), rng.random(1000), rng.random(1000)
    results = []
    try:
        for threads in (2, 1):
            numba.set_num_threads(threads)
            index = loaded_index(weights)
            index.set(slots, values)
            drawn = index.draw(u)
            assert numba.get_num_threads() == threads
            results.append((tuple(a.copy() for a in index.tree), drawn))
    finally:
        numba.set_num_threads(before)
    (tree2, drawn2), (tree1, drawn1) = results
    for a, b in zip(tree2, tree1):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(drawn2, drawn1)


@njit(parallel=True)
def _hand_out(n, done, first_lane_share):
    taken = np.empty(1, np.int64)
    taken[0] = 0
    for lane in prange(n):
        t = hints.take_next(taken)
        while t < n:
            done[t] += 1
            first_lane_share[lane] += 1
            t = hints.take_next(taken)
    return taken[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 64, 5000])
def test_take_next_hands_out_every_task_once(n, threads):
    """The parallel copies' work sharing (hints.take_next): every task exactly once, whatever lane takes it;
    the counter ends one past the tasks for every lane's final, empty take."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        done, share = np.zeros(n, np.int64), np.zeros(n, np.int64)
        end = _hand_out(n, done, share)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(done, np.ones(n, np.int64))
    assert share.sum() == n and end == 2 * n  # n tasks, then one empty take per lane
    if numba.get_num_threads() == 1 or threads == 1:
        assert share[0] == n  # one thread: its first lane takes everything


@njit(parallel=True)
def _one_fills_the_others_read(lanes, payload, seen, waited):
    ctl = hints.counters(2)
    ticket, ready = ctl[0:1], ctl[1:2]
    for lane in prange(lanes):
        if hints.take_next(ticket) == 0:  # the first lane in writes the payload, then raises the flag
            for i in range(payload.shape[0]):
                payload[i] = 3 * i + 1
            hints.raise_flag(ready)
            waited[lane] = 2
        elif hints.wait_flag(ready, 1 << 26, 1 << 40):
            waited[lane] = 1
        else:
            waited[lane] = -1
        seen[lane] = payload.sum() if waited[lane] > 0 else -1
    return ready[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_raised_flag_publishes_what_came_before(threads):
    """The one-call sample's hand-over (hints.raise_flag, wait_flag): one lane writes, raises the flag, and every
    lane that waited for the flag reads the whole payload; a flag never raised gives up after its spins; the
    raise returns the count before it."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for _ in range(20):
            n = 200_000
            payload, seen, waited = np.zeros(n, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64)
            assert _one_fills_the_others_read(8, payload, seen, waited) == 1
            assert (waited == 2).sum() == 1 and (waited == 1).sum() == 7  # one writer; the others saw the flag
            np.testing.assert_array_equal(seen, np.full(8, 3 * n * (n - 1) // 2 + n))
    finally:
        numba.set_num_threads(before)
    flag = np.zeros(1, np.int64)
    assert not njit(lambda f: hints.wait_flag(f, 1000, 1 << 40))(flag)
    assert njit(lambda f: hints.raise_flag(f))(flag) == 0 and flag[0] == 1
    assert njit(lambda f: hints.wait_flag(f, 1, 1 << 40))(flag)


@njit(parallel=True)
def _all_write_then_all_read(tasks, block, payload, seen):
    ctl = hints.counters(2)
    taken, done = ctl[0:1], ctl[1:2]
    for lane in prange(tasks):
        t = hints.take_next(taken)
        while t < tasks:  # each task writes its block, then counts itself done
            for i in range(t * block, (t + 1) * block):
                payload[i] = i + 1
            hints.raise_flag(done)
            t = hints.take_next(taken)
        if hints.wait_flag(done, 1 << 26, 1 << 40, tasks):  # every task's block written
            total = 0
            for i in range(payload.shape[0] - 1, -1, -1):  # from the end: the last tasks taken first
                total += payload[i]
            seen[lane] = total
        else:
            seen[lane] = -1


@pytest.mark.parametrize("threads", [1, 2])
def test_a_flag_counted_to_a_target_publishes_every_task(threads):
    """hints.wait_flag with a target (the update of a sampled batch waits so for every slice's checks): a lane that
    sees the count reach the number of tasks reads every task's writes."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for _ in range(20):
            tasks, block = 8, 50_000
            payload, seen = np.zeros(tasks * block, np.int64), np.zeros(tasks, np.int64)
            _all_write_then_all_read(tasks, block, payload, seen)
            n = tasks * block
            np.testing.assert_array_equal(seen, np.full(tasks, n * (n + 1) // 2))
    finally:
        numba.set_num_threads(before)


def test_a_wait_for_a_flag_gives_up_after_its_cycles():
    """hints.wait_flag's second bound: about ``cycles`` of the cycle counter, however many reads it may still
    make (2**40 reads would take hours), so that a thread never waits long for a drawing thread the OS preempted."""
    count = njit(lambda: hints.cycle_count())
    first = count()
    if count() == first:
        pytest.skip("no cycle counter on this processor: the bound is the reads'")
    wait = njit(lambda f, c: hints.wait_flag(f, 1 << 40, c))
    flag = np.zeros(1, np.int64)
    wait(flag, 1)
    start = time.perf_counter()
    assert not wait(flag, 1 << 22)  # a few milliseconds at most at any clock rate
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("window, b", [(12, 50), (64, 1500)])  # the second: over the kernel's serial size
def test_fill_mask_matches_numpy(window, b):
    rng = np.random.default_rng(window)
    rows = b + 10
    n_valid = rng.integers(0, window + 1, b)
    pad_front = np.array([rng.integers(0, window - nv + 1) for nv in n_valid])
    out_rows = rng.permutation(rows)[:b].astype(np.int64)
    mask = np.ones((rows, window), np.bool_)
    gather.fill_mask(n_valid.astype(np.int64), pad_front.astype(np.int64), out_rows, mask)
    t = np.arange(window)
    want = np.ones((rows, window), bool)
    want[out_rows] = (t >= pad_front[:, None]) & (t < (pad_front + n_valid)[:, None])
    np.testing.assert_array_equal(mask, want)


@pytest.mark.parametrize("align_code", [0, 1, 2])
def test_place_windows_matches_the_formula(align_code):
    rng = np.random.default_rng(align_code)
    b, window = 400, 10
    starts = rng.integers(0, 1000, b).astype(np.int64)
    lengths = rng.integers(1, 25, b).astype(np.int64)
    u = rng.random(b)
    u[:3] = [0.0, np.nextafter(1.0, 0.0), 0.5]
    win_start, n_valid, pad_front = (np.full(b, -1, np.int64) for _ in range(3))
    gather.place_windows(starts, lengths, window, align_code, u, win_start, n_valid, pad_front)
    for i in range(b):
        L = lengths[i]
        if L >= window:
            span = L - window + 1
            off = {0: min(int(u[i] * span), span - 1), 1: 0, 2: L - window}[align_code]
            assert (win_start[i], n_valid[i], pad_front[i]) == (starts[i] + off, window, 0)
            assert 0 <= off <= L - window
        else:
            assert (win_start[i], n_valid[i]) == (starts[i], L)
            assert pad_front[i] == (window - L if align_code == 2 else 0)


@pytest.mark.parametrize("align_code", [0, 1, 2])
def test_window_meta_and_place_slots_agree_with_place_windows(align_code):
    """The replay's owner-side kernel and the shard's: the same placement as place_windows, keys as
    keys.encode, probability w / total (1 without an index)."""
    from gear_mpi import keys as ks
    rng = np.random.default_rng(10 + align_code)
    n, b, window, capacity = 300, 500, 10, 2000
    start = rng.integers(0, 3000, n).astype(np.int64)   # ring positions, wrapped by the kernels
    length = rng.integers(1, 25, n).astype(np.int64)
    generation = rng.integers(0, 1 << 20, n).astype(np.int64)
    leaves = rng.random(n) + 0.1
    slots = rng.integers(0, n, b).astype(np.int64)
    u = rng.random(b)
    ws, nv, pf = (np.empty(b, np.int64) for _ in range(3))
    gather.place_windows(start[slots], length[slots], window, align_code, u, ws, nv, pf)
    ws %= capacity
    got = [np.empty(b, np.int64) for _ in range(3)]
    gather.place_slots(slots, start, length, capacity, window, align_code, u, *got)
    for a, w in zip(got, (ws, nv, pf)):
        np.testing.assert_array_equal(a, w)
    for lv, total in ((leaves, 7.5), (np.zeros(0), 1.0)):
        meta = np.empty((b, gather.CHOICE_WIDTH), np.int64)
        w = np.empty(b)
        gather.fill_choices(slots, start, length, generation, ks.key_head(9, 3), ks.SLOT_BITS, ks.GEN_MASK, capacity,
                            window, align_code, u, lv, total, meta, w)
        np.testing.assert_array_equal(meta[:, 0], ks.encode(9, 3, slots, generation[slots]))
        np.testing.assert_array_equal(meta[:, 1:4], np.stack([ws, nv, pf], 1))
        want = leaves[slots] / total if len(lv) else np.ones(b)
        np.testing.assert_array_equal(meta[:, 4].view(np.float64), want)
        np.testing.assert_array_equal(w, leaves[slots] if len(lv) else np.ones(b))


@pytest.mark.parametrize("counts, cols", [((40, 7, 33), (5, 1)),
                                          ((400, 7, 330), (300, 1))])  # over COPY_THREADS_BYTES: on the threads
def test_gather_from_owners_matches_numpy_and_checks_windows(counts, cols):
    """Two owners' columns read by address, one owner skipped (its rows come through MPI); ``cols``: the step
    bytes of two columns."""
    rng = np.random.default_rng(5)
    capacity, window = 97, 16
    owners = [[rng.integers(0, 256, capacity * sb).astype(np.uint8) for sb in cols] for _ in range(3)]
    addrs = np.array([[a.ctypes.data for a in cs] for cs in owners], np.int64)
    direct = np.array([True, False, True])
    counts = np.array(counts)
    row_of_owner = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    nb = int(counts.sum())
    assert (nb * window * sum(cols) >= gather.COPY_THREADS_BYTES) == (cols[0] > 5)
    n_valid = rng.integers(0, window + 1, nb)
    pad_front = np.array([rng.integers(0, window - v + 1) for v in n_valid])
    starts = rng.integers(0, capacity, nb)
    starts[:10] = capacity - 3  # these wrap
    n_valid[:10] = window
    pad_front[:10] = 0
    meta = np.zeros((nb, gather.CHOICE_WIDTH), np.int64)
    meta[:, 0] = rng.integers(0, 1 << 40, nb)
    meta[:, 1], meta[:, 2], meta[:, 3] = starts, n_valid, pad_front
    meta[:, 4] = rng.random(nb).view(np.int64)
    outs = tuple(np.full(nb * window * sb, 0xAB, np.uint8) for sb in cols)
    mask = np.ones((nb, window), np.bool_)
    keys, lengths, probs = np.empty(nb, np.int64), np.empty(nb, np.int64), np.empty(nb)
    gather.gather_from_owners(addrs, np.array(cols, np.int64), capacity, direct, row_of_owner, meta, outs, window,
                              mask, keys, lengths, probs)
    rows = np.arange(nb)
    for c, sb in enumerate(cols):
        want = np.full(nb * window * sb, 0xAB, np.uint8)
        for o in (0, 2):
            lo, hi = row_of_owner[o], row_of_owner[o + 1]
            reference_gather(owners[o][c], capacity, sb, starts[lo:hi], n_valid[lo:hi], pad_front[lo:hi],
                             rows[lo:hi], want, window)
        np.testing.assert_array_equal(outs[c], want)  # owner 1's rows untouched
    t = np.arange(window)
    np.testing.assert_array_equal(mask, (t >= pad_front[:, None]) & (t < (pad_front + n_valid)[:, None]))
    np.testing.assert_array_equal(keys, meta[:, 0])
    np.testing.assert_array_equal(lengths, n_valid)
    np.testing.assert_array_equal(probs, meta[:, 4].view(np.float64))
    bad = meta.copy()
    bad[5, 1] = capacity  # a window outside the ring: refused before any copy
    fresh = tuple(np.full_like(o, 0xAB) for o in outs)
    with pytest.raises(ValueError, match="outside the ring"):
        gather.gather_from_owners(addrs, np.array(cols, np.int64), capacity, direct, row_of_owner, bad, fresh, window,
                                  mask, keys, lengths, probs)
    assert all((o == 0xAB).all() for o in fresh)
    # outputs by address: a short, a non-contiguous or a missing column is refused before any copy
    for outs_bad, what in (((fresh[0], fresh[1][:-1]), "at least"), ((fresh[0], np.zeros(2 * len(fresh[1]),
                                                                      np.uint8)[::2]), "contiguous"),
                           ((fresh[0],), "2 columns")):
        with pytest.raises(ValueError, match=what):
            gather.gather_from_owners(addrs, np.array(cols, np.int64), capacity, direct, row_of_owner, meta, outs_bad,
                                      window, mask, keys, lengths, probs)
    assert all((o == 0xAB).all() for o in fresh)
    # one compiled kernel for any number of columns (a tuple argument would compile once per length)
    compiled = list(gather.gather_rows_from_owners.signatures)
    one = (np.zeros(nb * window * 5, np.uint8),)
    gather.gather_from_owners(addrs[:, :1].copy(), np.array([5], np.int64), capacity, direct, row_of_owner, meta, one,
                              window, mask, keys, lengths, probs)
    assert gather.gather_rows_from_owners.signatures == compiled, gather.gather_rows_from_owners.signatures


# ---- ring and table (through a Shard) ------------------------------------------------------------

def check_ring_invariants(shard: gm.Shard) -> None:
    st = shard.store
    s = st.state
    cap, n_slots = st.capacity, st.max_items
    count = int(s[ring.ORDER_COUNT])
    order = [int(st.order[(s[ring.ORDER_HEAD] + j) % n_slots]) for j in range(count)]
    assert len(set(order)) == count
    pos = int(s[ring.STEP_HEAD])
    alive = st.status >> ring.ALIVE_SHIFT  # the status row packs the alive code over the generation
    assert st.alive is st.status and st.generation is st.status
    for slot in order:  # entries (live or removed) lie back to back from the head
        assert alive[slot] in (ring.LIVE, ring.REMOVED)
        assert st.start[slot] == pos
        pos = (pos + int(st.length[slot])) % cap
    assert s[ring.STEPS_USED] == sum(int(st.length[x]) for x in order) <= cap
    live = [x for x in order if alive[x] == ring.LIVE]
    assert s[ring.LIVE_COUNT] == len(live) == len(shard)
    assert s[ring.LIVE_STEPS] == sum(int(st.length[x]) for x in live)
    if count:  # removed entries are trimmed from both ends
        assert alive[order[0]] == ring.LIVE and alive[order[-1]] == ring.LIVE
    free = ring.free_stack(s, st.start).tolist()  # linked through the free slots' start entries
    assert not set(free) & set(order)
    assert len(free) + count == s[ring.NEXT_FRESH] <= n_slots
    assert all(alive[x] == ring.DEAD for x in free)
    np.testing.assert_array_equal(ring.live_in_order(s, st.alive, st.order, False, n_slots), live)
    np.testing.assert_array_equal(ring.live_in_order(s, st.alive, st.order, True, 3), live[::-1][:3])
    assert s[ring.INSERTED_TOTAL] == s[ring.EVICTED_TOTAL] + s[ring.REMOVED_TOTAL] + len(live)
    if shard.index is not None:
        on = np.zeros(n_slots, bool)
        on[live] = True
        assert (shard.index.leaves[~on] == 0).all(), "a dead or removed slot keeps selection weight"


@pytest.mark.parametrize("sampler, max_times, max_items", [
    (gm.Uniform(), 2, None), (gm.Fifo(), 1, 12), (gm.MaxPriority(), 3, 9), (gm.Prioritized(0.5, 0.5), None, 6)])
def test_ring_bookkeeping_under_random_operations(shard_factory, spec, make_traj, sampler, max_times, max_items):
    shard = shard_factory(spec, 80, sampler, max_items=max_items, max_times_sampled=max_times, seed=5)
    rng = np.random.default_rng(17)
    data: dict[int, dict] = {}
    gens_seen: dict[int, int] = {}
    for _ in range(150):
        op = rng.random()
        if op < 0.45:
            tr = make_traj(int(rng.integers(1, 17)))
            data[shard.insert(tr, float(rng.uniform(0, 3)))] = tr
        elif op < 0.6:
            trs = [make_traj(int(rng.integers(1, 12))) for _ in range(int(rng.integers(1, 4)))]
            for k, tr in zip(shard.insert_many(trs, rng.uniform(0.1, 3, len(trs))).tolist(), trs):
                data[k] = tr
        elif len(shard) and shard.total_weight > 0:
            shard.sample(int(rng.integers(1, 6)), window=int(rng.integers(1, 17)))
        check_ring_invariants(shard)
        live = ring.live_in_order(shard.store.state, shard.store.alive, shard.store.order, False, 10**6)
        keys = shard.store.keys_of(live)
        for k in keys.tolist():
            assert shard.get(k)["t"].tobytes() == data[k]["t"].tobytes()
            _, _, gen, slot = keyspace.decode(np.array([k]))
            assert gen[0] >= gens_seen.get(int(slot[0]), 0)
            gens_seen[int(slot[0])] = int(gen[0])
        stale = set(data) - set(keys.tolist())
        for k in list(stale)[:5]:
            with pytest.raises(gm.StaleKeyError):
                shard.get(k)
    st = shard.stats()
    assert st["evicted"] + st["removed"] > 20


def test_slot_reuse_bumps_the_generation(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 100, max_items=1)
    seen = []
    for _ in range(5):
        k = shard.insert(make_traj(3))
        _, _, gen, slot = keyspace.decode(np.array([k]))
        seen.append((int(slot[0]), int(gen[0])))
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert shard.stats()["evicted"] == 4 and len(shard) == 1


def test_a_removed_trajectory_brought_to_the_head_by_eviction_gives_its_steps_back(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 40, gm.MaxPriority(), max_times_sampled=1)
    ka, kb, kc = (shard.insert(make_traj(10), p) for p in (1.0, 5.0, 2.0))
    assert shard.sample(1, window=1).keys.tolist() == [kb]  # b is removed but sits between a and c
    assert shard.stats()["steps_used"] == 30 and shard.stats()["live_steps"] == 20
    kd = shard.insert(make_traj(16), 0.5)  # evicts a; b reaches the head and must be released too
    st = shard.stats()
    assert st["items"] == 2 and st["evicted"] == 1 and st["removed"] == 1
    assert st["steps_used"] == st["live_steps"] == 26
    check_ring_invariants(shard)
    assert shard.locate(kc)[0][0] == shard.store.state[ring.STEP_HEAD] == 20
    assert shard.locate(kd)[0][0] == 30


def test_kernels_unpack_named_state_in_field_order():
    """The kernels receive a Table / Tree (or the plain tuple of its arrays) and unpack it by
    position: the names they unpack must be the field list, in its order."""
    import inspect
    import re
    cases = [(ring.TABLE_FIELDS, (ring.plan_insert, ring.count_samples)),
             (tree.TREE_FIELDS, (tree.set_leaves_into, tree.rebuild, priority_draw.draw))]
    for fields, kernels in cases:
        for kernel in kernels:
            src = inspect.getsource(kernel.py_func)
            m = re.search(r"^\s*([\w, ]+) = (table|tree)$", src, re.M)
            assert m is not None, kernel.__name__
            assert tuple(x.strip() for x in m.group(1).split(",")) == fields, kernel.__name__


def test_named_state_is_built_once_and_compiled_once(spec, make_traj):
    shard = gm.Shard(spec, 64, gm.Prioritized(), max_times_sampled=2, tag=1)
    arrays, tree_arrays = shard.store._arrays, shard.index._arrays
    assert shard.store.start is shard.store.table.start and shard.index.leaves is shard.index.tree.leaves
    for _ in range(3):
        shard.insert(make_traj(3))
        shard.sample(4, 2)
    counts = {k: len(k.signatures) for k in (ring.plan_insert, ring.count_samples, tree.set_leaves_into,
                                              priority_draw.draw)}
    for _ in range(5):
        shard.insert(make_traj(3))
        shard.sample(4, 2)
    assert {k: len(k.signatures) for k in counts} == counts
    assert shard.store._arrays is arrays and shard.index._arrays is tree_arrays
    shard.close()


# ---- a repeated sample's head row ----------------------------------------------------------------

@pytest.mark.parametrize("n", [1000, 200_000])  # a top level read as a list, and one reduced by numpy
def test_sample_head_reads_what_the_header_row_reads(n):
    """``serve.sample_head`` fills the head columns a repeated decentralized sample shares with exactly the
    values ``header.build_row`` reads through the shard: mass, live items, smallest positive weight, items ever
    inserted, windows drawn (zero priorities and an evicted item included)."""
    from gear_mpi.distributed import header
    from gear_mpi.kernels import serve

    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=3)
    rng = np.random.default_rng(3)
    k = n + 5  # five evicted: the live count and the inserted total differ
    priorities = rng.random(k) * 10.0
    priorities[rng.integers(0, k, k // 10)] = 0.0
    for part in (slice(0, n), slice(n, k)):  # (one call takes at most the capacity)
        m = part.stop - part.start
        shard.insert_packed({"x": rng.random(m, dtype=np.float32)}, np.ones(m, np.int64), priorities[part])
    shard.sample(7, 1)
    want = header.build_row(shard, 0, 1, 0, 0, 0, 0.0)
    head = np.full(16, -7.0)
    columns = 2 + np.array([header.MASS, header.ITEMS, header.MIN_WEIGHT, header.INSERTED, header.SAMPLED], np.int64)
    tree = shard.index.tree
    serve.sample_head(head, columns, 42.0, tree.prefix, tree.l2_min, shard.store.state, shard.samples_drawn)
    got = head[2:2 + header.HEADER_WIDTH]
    for col in (header.MASS, header.ITEMS, header.MIN_WEIGHT, header.INSERTED, header.SAMPLED):
        assert got[col] == want[col], col
    assert head[1] == 42.0 and head[0] == -7.0
    assert want[header.ITEMS] == n and want[header.INSERTED] == k and want[header.SAMPLED] == 7
    assert 0.0 < want[header.MIN_WEIGHT] < np.inf

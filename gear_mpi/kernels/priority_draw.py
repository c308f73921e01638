"""Batched proportional draws from the blocked priority structure (CPU kernels).

The structure (a :class:`~gear_mpi.kernels.priority_tree.Tree`) is described in
:mod:`~gear_mpi.kernels.priority_tree`. One draw (:func:`draw_one`) binary-searches
``prefix``, scans at most 64 level-1 sums, then 8 line sums and 8 leaves: two cache
misses. Batches (the sizes of replay: 1e4 to 1e6 draws over 1e7 to 1e9 items) go
through the structure in address order instead of at random: :func:`draw` sorts the
uniforms (O(B) counting sort), then walks each run of them left to right:
each draw finds its level-2 block by a galloping search from the previous draw's,
consecutive draws in one level-2 block resume its scan where the previous one
stopped, and lines are prefetched a stage ahead, so the misses overlap. Every draw
is bit-identical to :func:`draw_one` (and to the CUDA twin in ``cuda_priority``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .hints import prefetch as _prefetch
from .pipeline import SERIAL
from .priority_tree import FANOUT, LINE

# Fewer than DRAW_PIPE draws go one by one (sorting them costs more than it saves); from
# DRAW_THREADS_MIN draws the sorted batch is shared among the threads. Below that a parallel
# region is not worth it: a few microseconds of hand-off when the pool is idle and spinning,
# but a whole scheduler tick (~4 ms) when another process holds the other core. Measured on
# a 2-core machine, N = 1e5 and 1e7.
DRAW_THREADS_MIN = 512
# A large draw is cut into this many contiguous runs of sorted uniforms (a fixed count:
# asking numba for its thread count would stop the kernel from being cached).
DRAW_RUNS = 64
# Draws per software-pipeline stage: the level-1 step of this many draws (and a prefetch
# of each one's leaf block) before their leaf scans, so the leaf misses overlap.
DRAW_PIPE = 32


@njit(cache=True, inline="always")
def _scan(sums, lo, hi, r):
    """First index in [lo, hi) whose running sum exceeds ``r``; returns (index, r - mass before it).

    Falls back to the last positive entry when rounding leaves ``r`` past the end.
    """
    acc = 0.0
    last = -1
    for i in range(lo, hi):
        v = sums[i]
        if v > 0.0:
            if r < acc + v:
                return i, r - acc
            last = i
            acc += v
    if last < 0:
        return lo, 0.0
    return last, sums[last] * 0.5


@njit(cache=True, inline="always")
def _scan_line(sums, lo, hi, r):
    """:func:`_scan` of a line (``hi - lo <= LINE``) without a data-dependent branch: the same result.

    The running sums ``S[i + 1] = S[i] + sums[lo + i]`` are added in index order as in :func:`_scan`
    (adding an empty entry, 0, leaves a sum unchanged) and never decrease (rounding is monotone), so
    the entries with ``S[i + 1] <= r`` are a prefix; their count is the entry :func:`_scan` stops at
    (it passes ``r`` first, and is positive, as ``S`` grows there), the last of them the mass before it.
    Counted with selects, not a loop exit: a draw's exit point is random, so the branch that ends
    :func:`_scan` mispredicts about once a scan. ``r >= 0`` (as every caller's is). Past the end
    (rounding) it is :func:`_scan`'s fallback.
    """
    acc = 0.0
    before = 0.0
    cnt = 0
    if hi - lo == LINE:
        for i in range(LINE):  # a constant trip count: unrolled
            acc += sums[lo + i]
            le = acc <= r
            cnt += le
            before = acc if le else before
    else:
        for i in range(lo, hi):
            acc += sums[i]
            le = acc <= r
            cnt += le
            before = acc if le else before
    if cnt < hi - lo:
        return lo + cnt, r - before
    return _scan(sums, lo, hi, r)


@njit(cache=True, inline="always")
def _top_block(l2_sum, prefix, target, n2, lo):
    """The level-2 block of ``target`` (as in :func:`draw_one`); ``lo`` is a guess (-1: none).

    The last ``j`` with ``prefix[j] <= target``, then the step off empty blocks. From a guess at or below
    that ``j`` (the previous draw's block, for sorted targets) a galloping search: steps of 1, 2, 4, ... up
    ``prefix`` until one passes ``target``, then a binary search inside the last step, so a draw ``d``
    blocks further on costs O(log d) reads instead of O(log n2) (the guess itself when it is that ``j``);
    without one, a binary search over all blocks. The same ``j`` either way (``prefix`` never decreases).
    Returns (search result, block).
    """
    if lo >= 0 and prefix[lo] <= target:
        hi = lo + 1
        step = 1
        while hi < n2 and prefix[hi] <= target:
            lo = hi
            hi = lo + step
            step += step
        if hi > n2:
            hi = n2
    else:
        lo = 0
        hi = n2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefix[mid] <= target:
            lo = mid
        else:
            hi = mid
    j = lo
    while j > 0 and l2_sum[j] <= 0.0:
        j -= 1
    while j < n2 - 1 and l2_sum[j] <= 0.0:
        j += 1
    return lo, j


@njit(cache=True, inline="always")
def draw_one(leaves, l0_sum, l1_sum, l2_sum, prefix, u):
    """The leaf selected by ``u`` in [0, 1): P(leaf i) = leaves[i] / total. Cost: O(log(n/4096) + 80)."""
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    target = u * prefix[n2]
    _, j = _top_block(l2_sum, prefix, target, n2, -1)  # last j with prefix[j] <= target and a positive block
    r = target - prefix[j]
    b, r = _scan(l1_sum, j * FANOUT, min(j * FANOUT + FANOUT, n1), r)
    g, r = _scan(l0_sum, b * LINE, min(b * LINE + LINE, n0), r)
    leaf, r = _scan(leaves, g * LINE, min(g * LINE + LINE, n), r)
    return leaf


@njit(cache=True, nogil=True)
def _sort_order(uniforms):
    """``(order, keys)``: indices of ``uniforms`` in ascending order and the sorted values.

    O(B) expected for spread-out values: a counting sort into about B / 2 buckets
    that moves each value with its index, then an insertion sort that moves no value
    by more than 64 places (values crowded into one bucket may stay partly unsorted:
    the draw stays exact, only its locality suffers).
    """
    b = uniforms.shape[0]
    order = np.empty(b, np.int64)
    keys = np.empty(b, np.float64)
    _sort_order_into(uniforms, np.empty(max(1, b // 2) + 1, np.int64), order, keys)
    return order, keys


@njit(cache=True, nogil=True, parallel=SERIAL)
def _sort_order_into(uniforms, bounds, order, keys):
    """:func:`_sort_order` into the caller's arrays: ``order`` and ``keys`` of ``len(uniforms)`` entries,
    ``bounds`` (int64 scratch) of at least ``max(1, len(uniforms) // 2) + 1``. The same result."""
    b = uniforms.shape[0]
    nb = max(1, b // 2)
    for k in range(nb + 1):
        bounds[k] = 0
    for i in range(b):
        k = _bucket(uniforms[i], nb)
        bounds[k + 1] += 1
    for k in range(nb):
        bounds[k + 1] += bounds[k]
    for i in range(b):
        u = uniforms[i]
        k = _bucket(u, nb)
        order[bounds[k]] = i
        keys[bounds[k]] = u
        bounds[k] += 1
    _insertion_fix(order, keys, 0, b)


@njit(cache=True, inline="always")
def _bucket(u, nb):
    """The counting sort's bucket of ``u`` among ``nb`` (non-decreasing in ``u``)."""
    return min(max(int(u * nb), 0), nb - 1)


@njit(cache=True, inline="always")
def _insertion_fix(order, keys, lo, hi):
    """The insertion sort that ends :func:`_sort_order_into`, over ``keys[lo:hi]`` (whole buckets: no value
    moves past its bucket, and none by more than 64 places, so a crowded bucket costs O(64 B), not O(B^2));
    on whole buckets the same result as over the whole array, as values never cross a bucket's start."""
    for a in range(lo + 1, hi):
        ux = keys[a]
        if ux < keys[a - 1]:
            x = order[a]
            c = a - 1
            while c >= lo and keys[c] > ux and a - c <= 64:
                order[c + 1] = order[c]
                keys[c + 1] = keys[c]
                c -= 1
            order[c + 1] = x
            keys[c + 1] = ux


@njit(cache=True, inline="always")
def _resumable_scan(sums, lo, hi, r, block, cur, pos, acc0, last0):
    """Scan ``sums[lo:hi]`` for the first positive entry whose running sum passes ``r``.

    When ``block`` is the block the previous scan stopped in (``cur``) and ``r`` is
    not below that scan's running sum, resume at its stop (``pos``, ``acc0``,
    ``last0``) instead of the block start: the same sums, so the same result.
    Returns (entry or -1 when rounding runs past the end, running sum before it,
    last positive entry before it).
    """
    if block == cur and r >= acc0:
        p = pos
        acc = acc0
        last = last0
    else:
        p = lo
        acc = 0.0
        last = -1
    while p < hi:
        v = sums[p]
        if v > 0.0:
            if r < acc + v:
                return p, acc, last
            last = p
            acc += v
        p += 1
    return -1, acc, last


@njit(cache=True, nogil=True, parallel=SERIAL)
def _draw_run(leaves, l0_sum, l1_sum, l2_sum, prefix, keys, order, lo, hi, out):
    """Draws ``keys[lo:hi]`` (ascending uniforms) in one pass; draw ``k`` goes to ``out[order[k]]``.

    Each draw is bit-identical to :func:`draw_one` for its uniform.
    A scan of level-1 sums for ``r`` walks the same running sums as a scan for any
    ``r' >= r`` up to the entry it stopped at, so a draw that lands in the level-2
    block the previous draw stopped in resumes there (same ``acc``, same ``last``)
    instead of rescanning from the block start. Draws go in stages of ``DRAW_PIPE``:
    the level-1 step of each draw (prefetching its line sums), then the line-sum
    step (prefetching its leaf line), then the leaf scans, so the misses of a stage
    overlap.
    """
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    total = prefix[n2]
    top = -1
    # resume state: level-2 block, entry where the last scan stopped, running sum and last positive entry before it
    j_cur = -1
    j_pos = 0
    j_acc = 0.0
    j_last = -1
    stage_i = np.empty(DRAW_PIPE, np.int64)
    stage_r = np.empty(DRAW_PIPE, np.float64)
    for k0 in range(lo, hi, DRAW_PIPE):
        k1 = min(k0 + DRAW_PIPE, hi)
        # ---- level 1: scan the level-1 sums of level-2 block j
        for k in range(k0, k1):
            target = keys[k] * total
            top, j = _top_block(l2_sum, prefix, target, n2, top)
            r = target - prefix[j]
            blo = j * FANOUT
            bhi = min(blo + FANOUT, n1)
            b, acc, last = _resumable_scan(l1_sum, blo, bhi, r, j, j_cur, j_pos, j_acc, j_last)
            if b >= 0:
                j_cur = j
                j_pos = b
                j_acc = acc
                j_last = last
                r = r - acc
            else:
                j_cur = -1
                if last < 0:
                    b = blo
                    r = 0.0
                else:
                    b = last
                    r = l1_sum[last] * 0.5
            stage_i[k - k0] = b
            stage_r[k - k0] = r
            _prefetch(l0_sum, b * LINE)
        # ---- level 0: scan the 8 line sums of block b
        for k in range(k0, k1):
            b = stage_i[k - k0]
            g, r = _scan_line(l0_sum, b * LINE, min(b * LINE + LINE, n0), stage_r[k - k0])
            stage_i[k - k0] = g
            stage_r[k - k0] = r
            _prefetch(leaves, g * LINE)
        # ---- leaves: scan the 8 leaves of line g
        for k in range(k0, k1):
            g = stage_i[k - k0]
            leaf, r = _scan_line(leaves, g * LINE, min(g * LINE + LINE, n), stage_r[k - k0])
            out[order[k]] = leaf


@njit(cache=True, parallel=True, nogil=True)
def draw(tree, uniforms, out):
    """Batched proportional draws with replacement from ``tree`` (a :class:`Tree`, or the plain
    tuple of its arrays): ``out[i]`` is the leaf chosen by ``uniforms[i]``.

    Identical to ``draw_one`` for every ``i``. Batches of fewer than ``DRAW_PIPE``
    draws go one by one. Larger ones are put in ascending order (counting sort, O(B))
    and walked left to right, resuming the level-1 scan where the previous draw
    stopped and prefetching lines ahead (see :func:`_draw_run`); from
    ``DRAW_THREADS_MIN`` draws the sorted batch is cut into up to ``DRAW_RUNS``
    contiguous runs, shared among the threads. Cost: O(B) reads of two cache lines
    each (line sums, leaves), mostly in address order, plus a galloping search of
    ``prefix`` where consecutive draws change level-2 block (O(log d) for a step of d
    blocks: O(B log(1 + n / (4096 B))) in all); O(B)
    scratch (16 bytes per draw). The caller guarantees a positive total.
    """
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    nb = uniforms.shape[0]
    if nb < DRAW_PIPE:
        for i in range(nb):
            out[i] = draw_one(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms[i])
        return
    order, keys = _sort_order(uniforms)
    if nb < DRAW_THREADS_MIN:
        _draw_run(leaves, l0_sum, l1_sum, l2_sum, prefix, keys, order, 0, nb, out)
        return
    runs = max(2, min(DRAW_RUNS, nb // 256))
    for t in prange(runs):
        _draw_run(leaves, l0_sum, l1_sum, l2_sum, prefix, keys, order, t * nb // runs, (t + 1) * nb // runs, out)

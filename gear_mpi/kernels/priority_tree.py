"""A blocked priority structure for batched proportional draws (CPU kernels).

Layout, for ``n`` leaves, lines of ``LINE = 8`` leaves (one 64-byte cache line) and
blocks of ``FANOUT = 64`` leaves (8 lines)::

    leaves  float64[n]                  the weights (priority ** alpha, 1 for uniform, 0 when empty)
    l0_sum  float64[ceil(n / 8)]        sum of each line of 8 leaves
    l1_sum  float64[ceil(n / 64)]       sum of each block's 8 line sums
    l1_min  float64[ceil(n / 64)]       smallest positive leaf of each block (inf if none)
    l2_sum  float64[ceil(n / 64**2)]    sum of each block of 64 level-1 sums
    l2_min  float64[ceil(n / 64**2)]
    prefix  float64[len(l2_sum) + 1]    exclusive prefix sums of l2_sum; prefix[-1] is the total

A draw binary-searches ``prefix`` (``log2(n / 4096)`` steps over a cache-resident
array), scans at most 64 level-1 sums (a cache-resident array too: n / 8 bytes),
then the 8 sums of one line group and the 8 leaves of one line: two cache misses,
instead of the ``log2(n)`` dependent misses of a binary sum tree. An update writes
its leaf and recounts that leaf's line (the same cache line), then each touched
block from its 8 line sums (one more line) and each touched level-2 block from its
64 level-1 sums. Every sum is recomputed from its children, added in index order
(float64, no accumulated drift): the structure is a function of the leaves alone.
Block minima are exact too (lowered in place, recounted only when their value is
overwritten).

Batches (the sizes of replay: 1e4 to 1e6 draws over 1e7 to 1e9 items) go through
the structure in address order instead of at random. :func:`draw` sorts the
uniforms (O(B) counting sort), then walks each run of them left to right:
consecutive draws in one level-2 block resume its scan where the previous one
stopped, and lines are prefetched a stage ahead, so the misses overlap.
:func:`set_leaves` groups the slots by level-2 block (O(B) counting sort, stable, so
the last of duplicates still wins) and gives each group to one thread: one 32 KiB
span of leaves, no shared flags, the next group prefetched. Results are
bit-identical to :func:`draw_one` and to :func:`rebuild` (and to the CUDA twins in
``cuda_priority``).

Memory: ``8 n (1 + 1/8 + 2/64 + 2/4096) + n/64 + n/4096`` bytes, about 9.27 bytes per leaf.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .hints import prefetch as _prefetch

LINE = 8                      # leaves per line (one 64-byte cache line of float64)
FANOUT = 64                   # leaves per level-1 block (8 lines)
FANOUT2 = FANOUT * FANOUT     # leaves per level-2 block


def level_sizes(n: int) -> tuple[int, int]:
    """Return the lengths of level 1 and level 2 for ``n`` leaves."""
    n1 = max(1, -(-n // FANOUT))
    n2 = max(1, -(-n1 // FANOUT))
    return n1, n2


def line_count(n: int) -> int:
    """Return the length of level 0 (line sums) for ``n`` leaves."""
    return max(1, -(-n // LINE))


@njit(cache=True, inline="always")
def _children_sum_min(sums, mins, lo, hi):
    s = 0.0
    m = np.inf
    for i in range(lo, hi):
        s += sums[i]
        if mins[i] < m:
            m = mins[i]
    return s, m


@njit(cache=True)
def _rebuild_prefix(l2_sum, prefix):
    acc = 0.0
    prefix[0] = 0.0
    for j in range(l2_sum.shape[0]):
        acc += l2_sum[j]
        prefix[j + 1] = acc


@njit(cache=True, parallel=True)
def rebuild(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix):
    """Recompute every level from ``leaves``. Cost: O(n) reads, parallel."""
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    for b in prange(l1_sum.shape[0]):
        for g in range(b * LINE, min(b * LINE + LINE, n0)):
            _sum_group(leaves, l0_sum, g, n)
        _sum_group(l0_sum, l1_sum, b, n0)
        _recompute_l1_min(leaves, l1_min, b, n)
    n1 = l1_sum.shape[0]
    for c in prange(l2_sum.shape[0]):
        lo = c * FANOUT
        hi = min(lo + FANOUT, n1)
        s, m = _children_sum_min(l1_sum, l1_min, lo, hi)
        l2_sum[c] = s
        l2_min[c] = m
    _rebuild_prefix(l2_sum, prefix)


# Batches up to these sizes skip the sort / grouping pass (it costs more than it saves there):
# an update of at most SET_SERIAL_MAX slots runs serially; at most DRAW_SERIAL_MAX draws go
# one by one, in parallel from DRAW_THREADS_MIN draws. Below that a parallel region is not
# worth it: a few microseconds of hand-off when the pool is idle and spinning, but a whole
# scheduler tick (~4 ms) when another process holds the other core. Measured on a 2-core
# machine, N = 1e5 and 1e7.
SET_SERIAL_MAX = 512
DRAW_SERIAL_MAX = 2048
DRAW_THREADS_MIN = 512
# A large draw is cut into this many contiguous runs of sorted uniforms (a fixed count:
# asking numba for its thread count would stop the kernel from being cached).
DRAW_RUNS = 64
# Draws per software-pipeline stage: the level-1 step of this many draws (and a prefetch
# of each one's leaf block) before their leaf scans, so the leaf misses overlap.
DRAW_PIPE = 32


@njit(cache=True, inline="always")
def _sum_group(src, dst, i, n):
    """``dst[i]`` = the sum of the (up to) 8 entries ``src[8 i : min(8 i + 8, n)]``, in index order:
    a line's leaves into its line sum, or a block's line sums into its level-1 sum."""
    lo = i * LINE
    hi = min(lo + LINE, n)
    s = 0.0
    for k in range(lo, hi):
        s += src[k]
    dst[i] = s


@njit(cache=True, inline="always")
def _recompute_l1_min(leaves, l1_min, b, n):
    lo = b * FANOUT
    m = np.inf
    for i in range(lo, min(lo + FANOUT, n)):
        v = leaves[i]
        if v > 0.0 and v < m:
            m = v
    l1_min[b] = m


@njit(cache=True, inline="always")
def _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, c, n1):
    lo = c * FANOUT
    s, m = _children_sum_min(l1_sum, l1_min, lo, min(lo + FANOUT, n1))
    l2_sum[c] = s
    l2_min[c] = m


@njit(cache=True, inline="always")
def _write_leaf(leaves, l1_min, flags1, s, v):
    """``leaves[s] = v``, keeping the minimum of its block exact: lowered at once when ``v`` is a
    new smallest positive value; the block is marked for a recount (flag 2) when the value
    replaced was its minimum. Returns True the first time the block is touched (flag 0 -> 1)."""
    b = s // FANOUT
    old = leaves[s]
    leaves[s] = v
    first = flags1[b] == 0
    if first:
        flags1[b] = 1
    if v > 0.0 and v < l1_min[b]:
        l1_min[b] = v
    elif old > 0.0 and old == l1_min[b] and v != old:
        flags1[b] = 2
    return first


@njit(cache=True, inline="always")
def _finish_blocks(leaves, l0_sum, l1_sum, l1_min, flags1, slots, lo, hi, blocks, blo, bhi):
    """After the leaf writes of ``slots[lo:hi]``: recount their lines, then the sums of the touched
    blocks ``blocks[blo:bhi]`` from their lines (and their minimum where flagged); zero the flags."""
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    for k in range(lo, hi):
        _sum_group(leaves, l0_sum, slots[k] // LINE, n)
    for k in range(blo, bhi):
        b = blocks[k]
        _sum_group(l0_sum, l1_sum, b, n0)
        if flags1[b] == 2:
            _recompute_l1_min(leaves, l1_min, b, n)
        flags1[b] = 0


@njit(cache=True)
def _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots, values):
    """Small batches: write leaves in order, recount each touched line and block. O(B)."""
    n1 = l1_sum.shape[0]
    nb = slots.shape[0]
    blocks = np.empty(nb, np.int64)
    cnt = 0
    for i in range(nb):
        if _write_leaf(leaves, l1_min, flags1, slots[i], values[i]):
            blocks[cnt] = slots[i] // FANOUT
            cnt += 1
    _finish_blocks(leaves, l0_sum, l1_sum, l1_min, flags1, slots, 0, nb, blocks, 0, cnt)
    for i in range(nb):
        c = slots[i] // FANOUT2
        if flags2[c] == 0:
            flags2[c] = 1
            _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, c, n1)
    for i in range(nb):
        flags2[slots[i] // FANOUT2] = 0


@njit(cache=True)
def _group_by_top(slots, values, n2, bounds, gslots, gvalues):
    """Stable counting sort of (slot, value) pairs by level-2 block. O(B + n2), serial.

    On return group ``c`` is ``gslots[bounds[c]:bounds[c + 1]]`` in the original order.
    """
    for c in range(n2 + 1):
        bounds[c] = 0
    for i in range(slots.shape[0]):
        bounds[slots[i] // FANOUT2 + 1] += 1
    for c in range(n2):
        bounds[c + 1] += bounds[c]
    # scatter with a running cursor per group (bounds[c] is advanced, then restored)
    for i in range(slots.shape[0]):
        c = slots[i] // FANOUT2
        k = bounds[c]
        gslots[k] = slots[i]
        gvalues[k] = values[i]
        bounds[c] = k + 1
    for c in range(n2, 0, -1):
        bounds[c] = bounds[c - 1]
    bounds[0] = 0


@njit(cache=True, parallel=True)
def set_leaves(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix, flags1, flags2, slots, values):
    """Batched update: ``leaves[slots[i]] = values[i]`` (the last of duplicates wins).

    Cost: O(B): each update writes its leaf and recounts its line (the 8 leaves of
    one cache line), each touched level-1 block is re-summed once from its 8 line
    sums (one cache line) and each touched level-2 block from its 64 level-1 sums;
    a block minimum is lowered in place and recounted from its 64 leaves only when
    the value it held was overwritten; then O(n / 4096) for the prefix. Every sum is
    recomputed from its children in index order, so the result depends on the
    leaves only. Batches of up to ``SET_SERIAL_MAX`` run serially. Larger ones are
    first grouped by level-2 block (a stable counting sort, O(B + n / 4096), O(B)
    scratch); each group is then written by one thread, in parallel, within one
    32 KiB span of leaves, prefetching the next group's lines. ``flags1``/``flags2``
    are zeroed uint8 scratch of the level lengths; they are returned zeroed.
    """
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    nb = slots.shape[0]
    if nb <= SET_SERIAL_MAX:
        _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots, values)
    else:
        bounds = np.empty(n2 + 1, np.int64)
        gslots = np.empty(nb, np.int64)
        gvalues = np.empty(nb, np.float64)
        blocks = np.empty(nb, np.int64)  # touched level-1 blocks of group c, in blocks[bounds[c]:]
        _group_by_top(slots, values, n2, bounds, gslots, gvalues)
        for c in prange(n2):
            lo = bounds[c]
            hi = bounds[c + 1]
            if c + 1 < n2:
                for k in range(hi, bounds[c + 2]):
                    _prefetch(leaves, gslots[k])
                    _prefetch(l0_sum, gslots[k] // LINE)
            if hi > lo:
                cnt = lo
                for k in range(lo, hi):  # in the caller's order: the last duplicate wins
                    if _write_leaf(leaves, l1_min, flags1, gslots[k], gvalues[k]):
                        blocks[cnt] = gslots[k] // FANOUT  # level-1 blocks of this group belong to this thread only
                        cnt += 1
                _finish_blocks(leaves, l0_sum, l1_sum, l1_min, flags1, gslots, lo, hi, blocks, lo, cnt)
                _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, c, n1)
    _rebuild_prefix(l2_sum, prefix)


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
def _top_block(l2_sum, prefix, target, n2, lo):
    """The level-2 block of ``target`` (as in :func:`draw_one`); ``lo`` is a guess.

    Binary search for the last ``j`` with ``prefix[j] <= target``, skipped when the
    guess already is that ``j`` (sorted targets), then the step off empty blocks.
    Returns (search result, block).
    """
    if not (lo >= 0 and prefix[lo] <= target and (lo == n2 - 1 or prefix[lo + 1] > target)):
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


@njit(cache=True)
def _sort_order(uniforms):
    """``(order, keys)``: indices of ``uniforms`` in ascending order and the sorted values.

    O(B) expected for spread-out values: a counting sort into about B / 2 buckets
    that moves each value with its index, then an insertion sort that moves no value
    by more than 64 places (values crowded into one bucket may stay partly unsorted:
    the draw stays exact, only its locality suffers).
    """
    b = uniforms.shape[0]
    nb = max(1, b // 2)
    bounds = np.zeros(nb + 1, np.int64)
    for i in range(b):
        k = min(max(int(uniforms[i] * nb), 0), nb - 1)
        bounds[k + 1] += 1
    for k in range(nb):
        bounds[k + 1] += bounds[k]
    order = np.empty(b, np.int64)
    keys = np.empty(b, np.float64)
    for i in range(b):
        u = uniforms[i]
        k = min(max(int(u * nb), 0), nb - 1)
        order[bounds[k]] = i
        keys[bounds[k]] = u
        bounds[k] += 1
    # insertion sort of the whole, nearly sorted array: no value moves past its bucket
    # (and none by more than 64 places, so a crowded bucket costs O(64 B), not O(B^2))
    for a in range(1, b):
        ux = keys[a]
        if ux < keys[a - 1]:
            x = order[a]
            c = a - 1
            while c >= 0 and keys[c] > ux and a - c <= 64:
                order[c + 1] = order[c]
                keys[c + 1] = keys[c]
                c -= 1
            order[c + 1] = x
            keys[c + 1] = ux
    return order, keys


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


@njit(cache=True)
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
            g, r = _scan(l0_sum, b * LINE, min(b * LINE + LINE, n0), stage_r[k - k0])
            stage_i[k - k0] = g
            stage_r[k - k0] = r
            _prefetch(leaves, g * LINE)
        # ---- leaves: scan the 8 leaves of line g
        for k in range(k0, k1):
            g = stage_i[k - k0]
            leaf, r = _scan(leaves, g * LINE, min(g * LINE + LINE, n), stage_r[k - k0])
            out[order[k]] = leaf


@njit(cache=True, parallel=True)
def draw(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms, out):
    """Batched proportional draws with replacement: ``out[i]`` is the leaf chosen by ``uniforms[i]``.

    Identical to ``draw_one`` for every ``i``. Batches of more than
    ``DRAW_SERIAL_MAX`` are put in ascending order (counting sort, O(B)) and cut
    into ``DRAW_RUNS`` contiguous runs, shared among the threads; a run walks the
    structure left to right, resuming the level-1 scan where the previous draw
    stopped and prefetching lines ahead (see :func:`_draw_run`). Cost: O(B) reads
    of two cache lines each (line sums, leaves), mostly in address order, plus
    O(B log(n/4096)) cache-resident searches where consecutive draws change
    top-level block; O(B) scratch (16 bytes per draw). Smaller batches draw
    independently (in parallel from ``DRAW_THREADS_MIN`` draws). The caller
    guarantees a positive total.
    """
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

"""A blocked priority structure for batched proportional draws: layout, build and update (CPU kernels).

The draws over it are in :mod:`~gear_mpi.kernels.priority_draw`; the CUDA twins of
both in :mod:`~gear_mpi.kernels.cuda_priority`. The kernels take the structure as one
:class:`Tree` (its seven arrays, named).

Layout, for ``n`` leaves, lines of ``LINE = 8`` leaves (one 64-byte cache line) and
blocks of ``FANOUT = 64`` leaves (8 lines)::

    leaves  float32[n]                  the weights (priority ** alpha, 1 for uniform, 0 when empty),
                                        each rounded to float32 as it is written (:func:`leaf_value`)
    l0_sum  float64[ceil(n / 8)]        sum of each line of 8 leaves
    l1_sum  float64[ceil(n / 64)]       sum of each block's 8 line sums
    l1_min  float64[ceil(n / 64)]       smallest positive leaf of each block (inf if none)
    l2_sum  float64[ceil(n / 64**2)]    sum of each block of 64 level-1 sums
    l2_min  float64[ceil(n / 64**2)]
    prefix  float64[len(l2_sum) + 1]    exclusive prefix sums of l2_sum; prefix[-1] is the total

A draw binary-searches ``prefix`` (``log2(n / 4096)`` steps over a cache-resident
array; a sorted batch gallops from the previous draw's block instead), scans at most
64 level-1 sums (a cache-resident array too: n / 8 bytes), then the 8 sums of one line group and the 8 leaves of one line: two cache misses,
instead of the ``log2(n)`` dependent misses of a binary sum tree. An update writes
its leaf and recounts that leaf's line (the same cache line), then each touched
block from its 8 line sums (one more line) and each touched level-2 block from its
64 level-1 sums. Every sum is recomputed from its children, added in index order
(float64, no accumulated drift): the structure is a function of the leaves alone.
Block minima are exact too (lowered in place, recounted only when their value is
overwritten).

Batches (the sizes of replay: 1e4 to 1e6 updates over 1e7 to 1e9 items) go through
the structure in address order instead of at random: :func:`set_leaves` groups the
slots by level-2 block (O(B) counting sort, stable, so the last of duplicates still
wins) and gives each group to one thread: one 32 KiB span of leaves, no shared
flags, the next group's lines (leaves, line sums, level-1 sums and minima)
prefetched. Results are bit-identical to :func:`rebuild` (and to the CUDA twins
in ``cuda_priority``).

Leaves are float32 (half of the structure's bytes), every level above them float64: a weight is
rounded to float32 when it is written (:func:`leaf_value`: nearest, clamped to float32's positive
range, so a positive weight stays positive and finite), and every sum above is computed in float64
from those float32 values, in the same order as before. The draws are exact with respect to the
stored leaves; a weight differs from the one given by at most half a float32 ulp (2**-24 relative).

Memory: ``4 n + 8 n (1/8 + 2/64 + 2/4096) + n/64 + n/4096`` bytes, about 5.27 bytes per leaf.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange

from .hints import prefetch as _prefetch
from .pipeline import SERIAL

LINE = 8                      # leaves per line (a 32-byte half cache line of float32; a line sum is 8 bytes)
FANOUT = 64                   # leaves per level-1 block (8 lines)
FANOUT2 = FANOUT * FANOUT     # leaves per level-2 block

# The structure's arrays, in this order everywhere (the layout above; a checkpoint stores them in it).
TREE_FIELDS = ("leaves", "l0_sum", "l1_sum", "l1_min", "l2_sum", "l2_min", "prefix")
Tree = namedtuple("Tree", TREE_FIELDS)
LEAF_DTYPE = np.dtype(np.float32)  # the leaves' type (every level above: float64)
LEAF_MAX = float(np.finfo(np.float32).max)  # leaf_value's clamps: the largest float32 ...
LEAF_TINY = float(np.finfo(np.float32).smallest_subnormal)  # ... and the smallest positive one
Tree.__doc__ = """The arrays of one priority structure (host numpy arrays here, device arrays for
:mod:`~gear_mpi.kernels.cuda_priority`). Built once by its index.

The CPU kernels take it whole, as a ``Tree`` or as the plain tuple of its arrays in
``TREE_FIELDS`` order (``tuple(tree)``, which the index passes: numba types a plain
tuple of arrays in its C dispatcher, a named tuple through Python, about 1 us a call),
and unpack it in that order."""


def level_sizes(n: int) -> tuple[int, int]:
    """Return the lengths of level 1 and level 2 for ``n`` leaves."""
    n1 = max(1, -(-n // FANOUT))
    n2 = max(1, -(-n1 // FANOUT))
    return n1, n2


def line_count(n: int) -> int:
    """Return the length of level 0 (line sums) for ``n`` leaves."""
    return max(1, -(-n // LINE))


@njit(cache=True, inline="always")
def leaf_value(v):
    """The value a leaf holds for weight ``v`` (float64 in, float64 out): ``v`` rounded to float32, to
    nearest, except that a positive ``v`` stays positive and finite (clamped to ``[LEAF_TINY, LEAF_MAX]``)."""
    if v > LEAF_MAX:
        return LEAF_MAX
    if v > 0.0 and v < LEAF_TINY:
        return LEAF_TINY
    return np.float64(np.float32(v))


def leaf_values(weights: np.ndarray) -> np.ndarray:
    """:func:`leaf_value` of each weight (a new float64 array). O(n)."""
    w = np.asarray(weights, np.float64)
    with np.errstate(over="ignore"):
        out = w.astype(np.float32).astype(np.float64)
    out[w > LEAF_MAX] = LEAF_MAX
    out[(w > 0.0) & (w < LEAF_TINY)] = LEAF_TINY
    return out


@njit(cache=True, inline="always")
def least_positive(l2_min):
    """The smallest positive weight of a tree, from its level-2 minima ``l2_min`` (inf for none): what
    ``PriorityIndex.min_positive`` reads, inside a kernel. O(n / 4096)."""
    least = np.inf
    for j in range(l2_min.shape[0]):
        least = min(least, l2_min[j])
    return least


@njit(cache=True, inline="always")
def _children_sum_min(sums, mins, lo, hi):
    s = 0.0
    m = np.inf
    for i in range(lo, hi):
        s += sums[i]
        if mins[i] < m:
            m = mins[i]
    return s, m


@njit(cache=True, nogil=True)
def _rebuild_prefix(l2_sum, prefix):
    acc = 0.0
    prefix[0] = 0.0
    for j in range(l2_sum.shape[0]):
        acc += l2_sum[j]
        prefix[j + 1] = acc


@njit(cache=True, parallel=True, nogil=True)
def rebuild(tree):
    """Recompute every level of ``tree`` (a :class:`Tree`, or the plain tuple of its arrays) from its
    leaves. Cost: O(n) reads, parallel."""
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
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


# An update of at most SET_SERIAL_MAX slots runs serially, without the grouping pass (it
# costs more than it saves there, and a parallel region is not worth it: a few microseconds
# of hand-off when the pool is idle and spinning, but a whole scheduler tick (~4 ms) when
# another process holds the other core). Measured on a 2-core machine, N = 1e5 and 1e7.
SET_SERIAL_MAX = 512


@njit(cache=True, inline="always")
def _sum_group(src, dst, i, n):
    """``dst[i]`` = the sum of the (up to) 8 entries ``src[8 i : min(8 i + 8, n)]``, in index order:
    a line's leaves into its line sum, or a block's line sums into its level-1 sum."""
    lo = i * LINE
    hi = min(lo + LINE, n)
    s = 0.0
    if hi - lo == LINE:  # a whole line: a constant trip count, unrolled (the same additions, in the same order)
        for k in range(LINE):
            s += src[lo + k]
    else:
        for k in range(lo, hi):
            s += src[k]
    dst[i] = s


@njit(cache=True, inline="always")
def _recompute_l1_min(leaves, l1_min, b, n):
    lo = b * FANOUT
    m = np.inf
    for i in range(lo, min(lo + FANOUT, n)):
        v = np.float64(leaves[i])
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
    """``leaves[s] = leaf_value(v)``, keeping the minimum of its block exact: lowered at once when the
    value is a new smallest positive one; the block is marked for a recount (flag 2) when the value
    replaced was its minimum. Returns True the first time the block is touched (flag 0 -> 1)."""
    b = s // FANOUT
    v = leaf_value(v)
    old = np.float64(leaves[s])
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


SET_AHEAD = 8  # slots ahead whose lines _set_serial requests


@njit(cache=True, inline="always")
def _prefetch_slot(leaves, l0_sum, l1_sum, l1_min, flags1, s):
    _prefetch(leaves, s)
    _prefetch(l0_sum, s // LINE)
    _prefetch(l1_sum, s // FANOUT)
    _prefetch(l1_min, s // FANOUT)
    _prefetch(flags1, s // FANOUT)


@njit(cache=True, nogil=True, parallel=SERIAL)
def _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots, values):
    """Small batches: write leaves in order, recount each touched line and block. O(B).

    The lines of the slot ``SET_AHEAD`` places later (its leaf, line sum, level-1 sum, minimum and flag) are
    requested while a slot is written: a replay's slots are random, so each one is a few cache misses."""
    n1 = l1_sum.shape[0]
    nb = slots.shape[0]
    blocks = np.empty(nb, np.int64)
    cnt = 0
    for i in range(min(SET_AHEAD, nb)):
        _prefetch_slot(leaves, l0_sum, l1_sum, l1_min, flags1, slots[i])
    for i in range(nb):
        if i + SET_AHEAD < nb:
            _prefetch_slot(leaves, l0_sum, l1_sum, l1_min, flags1, slots[i + SET_AHEAD])
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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True, parallel=SERIAL)
def set_leaves(tree, flags1, flags2, slots, values):
    """Batched update of ``tree`` (a :class:`Tree`, or the plain tuple of its arrays):
    ``leaves[slots[i]] = values[i]`` (the last of duplicates wins).

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
    nb = slots.shape[0]
    big = nb > SET_SERIAL_MAX
    set_leaves_into(tree, flags1, flags2, slots, values, np.empty(tree[4].shape[0] + 1 if big else 0, np.int64),
                    np.empty(nb if big else 0, np.int64), np.empty(nb if big else 0, np.float64),
                    np.empty(nb if big else 0, np.int64))


@njit(cache=True, parallel=True, nogil=True)
def set_leaves_into(tree, flags1, flags2, slots, values, bounds, gslots, gvalues, blocks):
    """:func:`set_leaves` on the caller's scratch (needed above ``SET_SERIAL_MAX`` slots; kept between calls
    by the index, so no fresh pages fault in): ``bounds`` int64 of at least ``len(l2_sum) + 1`` entries,
    ``gslots``, ``gvalues`` (float64) and ``blocks`` of at least ``len(slots)``. The same result."""
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    nb = slots.shape[0]
    if nb <= SET_SERIAL_MAX:
        _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots, values)
    else:  # blocks: the touched level-1 blocks of group c, in blocks[bounds[c]:]
        _group_by_top(slots, values, n2, bounds, gslots, gvalues)
        for c in prange(n2):
            lo = bounds[c]
            hi = bounds[c + 1]
            if c + 1 < n2:
                for k in range(hi, bounds[c + 2]):
                    _prefetch(leaves, gslots[k])
                    _prefetch(l0_sum, gslots[k] // LINE)
                if bounds[c + 2] > hi:  # and the next group's level-1 sums and minima (8 lines each)
                    for q in range((c + 1) * FANOUT, min((c + 2) * FANOUT, n1), LINE):
                        _prefetch(l1_sum, q)
                        _prefetch(l1_min, q)
            if hi > lo:
                cnt = lo
                for k in range(lo, hi):  # in the caller's order: the last duplicate wins
                    if _write_leaf(leaves, l1_min, flags1, gslots[k], gvalues[k]):
                        blocks[cnt] = gslots[k] // FANOUT  # level-1 blocks of this group belong to this thread only
                        cnt += 1
                _finish_blocks(leaves, l0_sum, l1_sum, l1_min, flags1, gslots, lo, hi, blocks, lo, cnt)
                _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, c, n1)
    _rebuild_prefix(l2_sum, prefix)

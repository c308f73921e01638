"""A blocked priority structure for batched proportional draws (CPU kernels).

Layout, for ``n`` leaves and fan-out ``F = 64``::

    leaves  float64[n]                  the weights (priority ** alpha, 1 for uniform, 0 when empty)
    l1_sum  float64[ceil(n / F)]        sum of each block of F leaves
    l1_min  float64[ceil(n / F)]        smallest positive leaf of each block (inf if none)
    l2_sum  float64[ceil(n / F**2)]     sum of each block of F level-1 sums
    l2_min  float64[ceil(n / F**2)]
    prefix  float64[len(l2_sum) + 1]    exclusive prefix sums of l2_sum; prefix[-1] is the total

A draw binary-searches ``prefix`` (``log2(n / 4096)`` steps over a cache-resident
array), then scans at most ``F`` level-1 sums and at most ``F`` leaves: two
contiguous 512-byte reads. That is a 4096-ary tree with a flat top, so a draw costs
about 3 cache misses instead of the ``log2(n)`` dependent misses of a binary sum tree.
Updates write leaves, then recompute each touched block once from its children
(float64, no accumulated drift), then rebuild ``prefix`` (``n / 4096`` adds).

Memory: ``8 n (1 + 2/64 + 2/4096) + n/64 + n/4096`` bytes, about 8.27 bytes per leaf.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

FANOUT = 64
FANOUT2 = FANOUT * FANOUT


def level_sizes(n: int) -> tuple[int, int]:
    """Return the lengths of level 1 and level 2 for ``n`` leaves."""
    n1 = max(1, -(-n // FANOUT))
    n2 = max(1, -(-n1 // FANOUT))
    return n1, n2


@njit(cache=True, inline="always")
def _block_sum_min(values, lo, hi):
    s = 0.0
    m = np.inf
    for i in range(lo, hi):
        v = values[i]
        s += v
        if v > 0.0 and v < m:
            m = v
    return s, m


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
def rebuild(leaves, l1_sum, l1_min, l2_sum, l2_min, prefix):
    """Recompute every level from ``leaves``. Cost: O(n) reads, parallel."""
    n = leaves.shape[0]
    for b in prange(l1_sum.shape[0]):
        lo = b * FANOUT
        hi = min(lo + FANOUT, n)
        s, m = _block_sum_min(leaves, lo, hi)
        l1_sum[b] = s
        l1_min[b] = m
    n1 = l1_sum.shape[0]
    for c in prange(l2_sum.shape[0]):
        lo = c * FANOUT
        hi = min(lo + FANOUT, n1)
        s, m = _children_sum_min(l1_sum, l1_min, lo, hi)
        l2_sum[c] = s
        l2_min[c] = m
    _rebuild_prefix(l2_sum, prefix)


@njit(cache=True)
def _dirty_blocks(slots, shift_div, flags):
    """Unique block ids ``slots // shift_div`` in first-seen order (serial, O(len(slots)))."""
    out = np.empty(slots.shape[0], dtype=np.int64)
    k = 0
    for i in range(slots.shape[0]):
        b = slots[i] // shift_div
        if flags[b] == 0:
            flags[b] = 1
            out[k] = b
            k += 1
    for i in range(k):
        flags[out[i]] = 0
    return out[:k]


@njit(cache=True, parallel=True)
def set_leaves(leaves, l1_sum, l1_min, l2_sum, l2_min, prefix, flags1, flags2, slots, values):
    """Batched update: ``leaves[slots[i]] = values[i]`` (the last of duplicates wins).

    Cost: O(B) leaf writes, O(F) per touched level-1 block and per touched level-2
    block (each recomputed once, in parallel), then O(n / 4096) for the prefix.
    ``flags1``/``flags2`` are zeroed uint8 scratch of the level lengths; they are
    returned zeroed.
    """
    n = leaves.shape[0]
    n1 = l1_sum.shape[0]
    for i in range(slots.shape[0]):
        leaves[slots[i]] = values[i]
    blocks1 = _dirty_blocks(slots, FANOUT, flags1)
    for k in prange(blocks1.shape[0]):
        b = blocks1[k]
        lo = b * FANOUT
        hi = min(lo + FANOUT, n)
        s, m = _block_sum_min(leaves, lo, hi)
        l1_sum[b] = s
        l1_min[b] = m
    blocks2 = _dirty_blocks(slots, FANOUT2, flags2)
    for k in prange(blocks2.shape[0]):
        c = blocks2[k]
        lo = c * FANOUT
        hi = min(lo + FANOUT, n1)
        s, m = _children_sum_min(l1_sum, l1_min, lo, hi)
        l2_sum[c] = s
        l2_min[c] = m
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
def draw_one(leaves, l1_sum, l2_sum, prefix, u):
    """The leaf selected by ``u`` in [0, 1): P(leaf i) = leaves[i] / total. Cost: O(log(n/4096) + 2F)."""
    n = leaves.shape[0]
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    target = u * prefix[n2]
    # last j with prefix[j] <= target and a positive block
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
    r = target - prefix[j]
    b, r = _scan(l1_sum, j * FANOUT, min(j * FANOUT + FANOUT, n1), r)
    leaf, r = _scan(leaves, b * FANOUT, min(b * FANOUT + FANOUT, n), r)
    return leaf


@njit(cache=True, parallel=True)
def draw(leaves, l1_sum, l2_sum, prefix, uniforms, out):
    """Batched proportional draws with replacement: ``out[i]`` is the leaf chosen by ``uniforms[i]``.

    Cost: O(B (log(n/4096) + 2F)) reads, parallel over draws; no allocation.
    The caller guarantees a positive total.
    """
    for i in prange(uniforms.shape[0]):
        out[i] = draw_one(leaves, l1_sum, l2_sum, prefix, uniforms[i])

"""A priority update of the keys of the batch just sampled, in the draw's slot order (CPU kernels; issue 34).

A training loop samples a batch, computes new priorities and sets them for the batch's keys. The one-call
sample (:mod:`~gear_mpi.kernels.local_sample`) has just drawn those slots in ascending order: its scratch
holds the sorted slots (``sslots``), the batch row of each (``order``) and the inverse (``inv``). The
general update (``resolve_live``, the weights' power, then :func:`~gear_mpi.kernels.priority_tree.set_leaves`)
resolves the keys in batch order, one random table line after another on one thread, powers the weights in a
second pass, and groups the slots again by level-2 block (a counting sort) before writing the tree. Here the
sorted slots serve as they are: one pass in batch order checks the input and writes each key's priority and
generation at its sorted position; then each thread takes a run of sorted slots that starts and ends on a
level-2 block boundary, computes its new leaves (``weights.leaf_powers_into``: a vectorised power, ``pow`` only
where the float32 rounding is in doubt; the same leaves), and walks it: checks each key's status, writes its raw
priority and leaf, and recounts each line, level-1 block and level-2 block once, when the walk leaves it. The
table's and tree's lines are read in ascending address order, prefetched ahead, and the run's own rows in order.
(W3, N = 1e7, B = 65536, two threads, an update: 2.8 ms with ``pow`` called inside the walk, between its cache
misses; 2.2 ms with the leaves computed in a pass of their own; 1.8 ms with the keys and priorities read in slot
order instead of at their batch rows.)

The result is the general path's, bit for bit: the same raw priorities, leaves, sums and minima (every sum
recomputed from its children in index order; a block minimum lowered in place or recounted where the value
it held was overwritten), the same count of applied keys; of duplicate keys the last live one in batch
order wins (duplicates of a slot are adjacent in slot order: the one with the largest batch row). Nothing is
written unless every check passes: priorities finite and non-negative, every key this shard's, and the
scratch describing exactly these keys (``order`` and ``inv`` inverse permutations, ``sslots``
non-decreasing, ``sslots[inv[i]]`` the slot of ``keys[i]``); otherwise the caller takes the general path,
which raises the errors.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..keys import GEN_MASK, RANK_MASK, SLOT_MASK, TAG_MASK, _GEN_SHIFT, _RANK_SHIFT, _TAG_SHIFT
from .hints import WAIT_CYCLES, WAIT_SPINS, counters, flag_value, raise_flag, take_next, wait_flag
from .hints import prefetch as _prefetch
from .pipeline import SERIAL
from .priority_tree import FANOUT, FANOUT2, LINE, _rebuild_prefix, _recompute_l1_min, _recompute_l2, _sum_group
from .weights import leaf_powers_into

AHEAD = 16  # sorted items ahead whose lines are requested
#: from this many keys the update is shared among the threads (one parallel region, which wakes the sleeping
#: workers: OMP_WAIT_POLICY=PASSIVE, gear_mpi.threads). Timed where it runs, after a sample (the worker has
#: slept through it), at two threads on the reference VM, N = 1e6 one-float items, a sample + update step, us:
#: B = 8192 994-1056 with the update on the threads against 866-949 on the caller; 16384 1670-1792 against
#: 1742-1792 (one thread: 981, 1803); the update alone, back to back, favours the threads from 8192 (171-184
#: against 247-262 us), but a training loop leaves the worker asleep longer still
PARALLEL_MIN = 16384


@njit(cache=True, inline="always")
def _checks(keys, priorities, sslots, order, inv, tag, rank, max_items, lo, hi, sorted_p, sorted_gen):
    """Whether keys ``lo:hi`` and their priorities pass every check (see the module); on the way, each key's
    priority and generation are written at its sorted position (``sorted_p[inv[i]]``, ``sorted_gen[inv[i]]``),
    so that the writes in slot order read them in order instead of at random batch rows."""
    n = keys.shape[0]
    for i in range(lo, hi):
        v = priorities[i]
        if not (v >= 0.0 and v < np.inf):
            return False
        k = keys[i]
        if k < 0 or ((k >> _TAG_SHIFT) & TAG_MASK) != tag or ((k >> _RANK_SHIFT) & RANK_MASK) != rank \
                or (k & SLOT_MASK) >= max_items:
            return False
        j = inv[i]
        if j < 0 or j >= n or order[j] != i or sslots[j] != (k & SLOT_MASK):
            return False
        if j > 0 and sslots[j - 1] > sslots[j]:
            return False
        sorted_p[j] = v
        sorted_gen[j] = (k >> _GEN_SHIFT) & GEN_MASK
    return True


@njit(cache=True, inline="always")
def _boundary(sslots, k):
    """The first sorted position at or after ``k`` where a new level-2 block starts (or ``len(sslots)``)."""
    n = sslots.shape[0]
    if k <= 0:
        return 0
    while k < n and sslots[k] // FANOUT2 == sslots[k - 1] // FANOUT2:
        k += 1
    return k


@njit(cache=True, inline="always")
def _write_run(sslots, order, sorted_p, sorted_gen, sorted_leaf, status, alive_shift, live_code, raw, keep_raw,
               alpha, powered, leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, lo, hi):
    """Sorted items ``lo:hi`` (whole level-2 blocks): their new leaves computed (``sorted_leaf``, from
    ``sorted_p`` by ``weights.leaf_powers_into``, vectorised, where ``powered``; else 1), statuses checked against
    ``sorted_gen``, raw priorities and leaves written, each touched line, level-1 block and level-2 block
    recounted once. Returns the live keys applied."""
    if powered:  # (a pass of its own, away from the walk's cache misses: see weights.leaf_powers_into)
        leaf_powers_into(sorted_p, alpha, sorted_leaf, lo, hi)
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    n1 = l1_sum.shape[0]
    applied = 0
    gcur = -1
    bcur = -1
    ccur = -1
    recount = False
    for k in range(lo, min(lo + AHEAD, hi)):
        t = sslots[k]
        _prefetch(status, t)
        _prefetch(leaves, t)
        _prefetch(l0_sum, t // LINE)
    k = lo
    while k < hi:
        s = sslots[k]
        best = -1
        live = 0
        st = np.int64(status[s])
        alive = (st >> alive_shift) == live_code
        kbest = -1
        while k < hi and sslots[k] == s:  # duplicates of a slot are adjacent: the last live one in batch order wins
            if k + AHEAD < hi:
                t = sslots[k + AHEAD]
                _prefetch(status, t)
                _prefetch(leaves, t)
                _prefetch(l0_sum, t // LINE)
                if keep_raw:
                    _prefetch(raw, t)
            if alive and (st & GEN_MASK) == sorted_gen[k]:
                live += 1
                i = order[k]
                if i > best:
                    best = i
                    kbest = k
            k += 1
        if live == 0:
            continue
        applied += live
        p = sorted_p[kbest] + 0.0  # -0.0 as +0.0
        if keep_raw:
            raw[s] = p
        g = s // LINE
        b = s // FANOUT
        c = s // FANOUT2
        if g != gcur:  # leaving a line, then a block, then a level-2 block: each recounted once, inner first
            if gcur >= 0:
                _sum_group(leaves, l0_sum, gcur, n)
            gcur = g
        if b != bcur:
            if bcur >= 0:
                _sum_group(l0_sum, l1_sum, bcur, n0)
                if recount:
                    _recompute_l1_min(leaves, l1_min, bcur, n)
            bcur = b
            recount = False
        if c != ccur:
            if ccur >= 0:
                _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, ccur, n1)
            ccur = c
        v = sorted_leaf[kbest] if powered else 1.0
        old = np.float64(leaves[s])
        leaves[s] = v
        if v > 0.0 and v < l1_min[b]:
            l1_min[b] = v
        elif old > 0.0 and old == l1_min[b] and v != old:
            recount = True
    if gcur >= 0:
        _sum_group(leaves, l0_sum, gcur, n)
        _sum_group(l0_sum, l1_sum, bcur, n0)
        if recount:
            _recompute_l1_min(leaves, l1_min, bcur, n)
        _recompute_l2(l1_sum, l1_min, l2_sum, l2_min, ccur, n1)
    return applied


@njit(cache=True, nogil=True, parallel=SERIAL)  # (pipeline.SERIAL: no reference counting in its loop)
def update_sampled(keys, priorities, sslots, order, inv, tag, rank, max_items, status, alive_shift, live_code, raw,
                   keep_raw, alpha, powered, tree, sorted_p, sorted_gen, sorted_leaf):
    """Set the priorities of ``keys``, the batch whose sorted draw ``sslots``/``order``/``inv`` describe (see the
    module), on one thread: each live key's raw priority (``raw[slot] = p + 0.0`` where ``keep_raw``) and index
    weight (``p ** alpha`` as ``weights._power`` where ``powered``, else 1; its leaf as ``leaf_value`` rounds it,
    by ``weights.leaf_powers_into``).

    Args:
        keys: int64 keys; priorities: float64, one per key (not yet checked).
        sslots, order, inv: int64 rows of ``len(keys)``: the sample's sorted slots, batch row of each, inverse.
        tag, rank, max_items: the shard's key tag, rank and table slots; status: the table's status row;
            alive_shift, live_code: its live test (``ring.ALIVE_SHIFT``, ``ring.LIVE``).
        raw, keep_raw: the table's raw-priority row (any float64 array when not kept) and whether it is kept.
        alpha, powered: the selector's exponent, and whether weights are powers (else all 1).
        tree: the host index's arrays (``PriorityIndex._arrays``).
        sorted_p, sorted_gen, sorted_leaf: scratch rows of ``len(keys)`` (float64, int64, float64): the priorities,
            the keys' generations and the new leaves in slot order.
    Returns:
        The live keys applied, or -1 (nothing written) when a check fails: the caller takes the general path.
    Cost: O(B), two passes: the checks in batch order (writing each key's priority and generation at its sorted
    position), then in slot order the new leaves (vectorised) and the writes; the table's and tree's lines in
    ascending address order.
    """
    if not _checks(keys, priorities, sslots, order, inv, tag, rank, max_items, 0, keys.shape[0], sorted_p,
                   sorted_gen):
        return -1
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    applied = _write_run(sslots, order, sorted_p, sorted_gen, sorted_leaf, status, alive_shift, live_code, raw,
                         keep_raw, alpha, powered, leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, 0, keys.shape[0])
    _rebuild_prefix(l2_sum, prefix)
    return applied


@njit(cache=True, parallel=True, nogil=True)
def update_sampled_parallel(keys, priorities, sslots, order, inv, tag, rank, max_items, status, alive_shift,
                            live_code, raw, keep_raw, alpha, powered, tree, sorted_p, sorted_gen, sorted_leaf, chunks):
    """:func:`update_sampled` shared among the threads: the checks in ``chunks`` slices of the keys, then the new
    leaves and the writes in ``chunks`` runs of sorted items cut at level-2 block boundaries (no two threads share
    a line or a block). The same result. One parallel region (one wake-up of sleeping workers): slices and
    runs are handed out as the threads arrive (``hints.take_next``); a thread done with the checks waits for every
    slice's (``hints.wait_flag``, bounded: a thread that gives up leaves the runs to the others; the one that
    finishes the last check never waits), and nothing is written unless every check passed. Cost: O(B) over the
    threads plus O(n / 4096) for the prefix."""
    n = keys.shape[0]
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    # hints.counters, np.empty and plain loops: np.ones, np.zeros and .sum() would each be a parallel region of
    # their own here (numba makes them parfors), each waking the sleeping workers once more
    ctl = counters(4)
    check_taken, checked, failed, write_taken = ctl[0:1], ctl[1:2], ctl[2:3], ctl[3:4]
    counts = np.empty(chunks, np.int64)
    for _ in prange(chunks):
        t = take_next(check_taken)
        while t < chunks:
            lo = t * n // chunks
            hi = (t + 1) * n // chunks
            if not _checks(keys, priorities, sslots, order, inv, tag, rank, max_items, lo, hi, sorted_p, sorted_gen):
                raise_flag(failed)
            raise_flag(checked)  # (release: the failure, if any, is seen by whoever sees this count)
            t = take_next(check_taken)
        if wait_flag(checked, WAIT_SPINS, WAIT_CYCLES, chunks) and flag_value(failed) == 0:
            t = take_next(write_taken)
            while t < chunks:
                lo = _boundary(sslots, t * n // chunks)
                hi = _boundary(sslots, (t + 1) * n // chunks)
                counts[t] = 0
                if hi > lo:
                    counts[t] = _write_run(sslots, order, sorted_p, sorted_gen, sorted_leaf, status, alive_shift,
                                           live_code, raw, keep_raw, alpha, powered, leaves, l0_sum, l1_sum, l1_min,
                                           l2_sum, l2_min, lo, hi)
                t = take_next(write_taken)
    if failed[0] != 0:
        return -1
    _rebuild_prefix(l2_sum, prefix)
    applied = 0
    for t in range(chunks):
        applied += counts[t]
    return applied

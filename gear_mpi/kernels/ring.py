"""Step ring and trajectory table bookkeeping (CPU kernels over the table arrays).

The table is one :class:`Table`: the per-slot rows (``TABLE_ROWS``: ``start``,
``length``, ``priority``, ``generation``, ``seq``, ``stamp``, ``times_sampled``,
``alive``), a ring ``order`` of slots in insertion order, a stack ``free`` of
recycled slots, and ``state``, an int64 array of the counters below. Steps of live
trajectories occupy the ring contiguously in insertion order, so the oldest
trajectory always sits at ``state[STEP_HEAD]``.

``alive``: 0 free or evicted, 1 live, 2 removed (by ``max_times_sampled``) but
still holding its steps until it reaches an end of the order ring.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

STEP_HEAD = 0
STEPS_USED = 1
ORDER_HEAD = 2
ORDER_COUNT = 3
FREE_TOP = 4
NEXT_FRESH = 5
NEXT_SEQ = 6
LIVE_COUNT = 7
LIVE_STEPS = 8
EVICTED_TOTAL = 9
REMOVED_TOTAL = 10
INSERTED_TOTAL = 11
STATE_SIZE = 12

DEAD = 0
LIVE = 1
REMOVED = 2

# One row per slot, in this order everywhere (a checkpoint stores them in it).
TABLE_ROWS = ("start", "length", "priority", "generation", "seq", "stamp", "times_sampled", "alive")
TABLE_FIELDS = TABLE_ROWS + ("order", "free", "state")
Table = namedtuple("Table", TABLE_FIELDS)
Table.__doc__ = """The arrays of one trajectory table: int64 rows except ``priority`` (float64) and
``alive`` (uint8), the ``order`` ring and ``free`` stack (int64, one entry per slot), and
``state`` (int64[STATE_SIZE]). Built once by its store.

The kernels take it whole, as a ``Table`` or as the plain tuple of its arrays in
``TABLE_FIELDS`` order (``tuple(table)``, which the store passes: numba types a plain
tuple of arrays in its C dispatcher, a named tuple through Python, about 1 us a call),
and unpack it in that order."""


def ring_segments(head: int, used: int, size: int) -> list[tuple[int, int]]:
    """The index ranges ``[a, b)`` of ``used`` consecutive entries of a ring of ``size`` from ``head``.

    Args:
        head: the position of the oldest entry, in ``[0, size)``.
        used: how many entries are in use, in ``[0, size]``.
        size: the ring's length.

    Returns:
        At most two ranges, oldest first (none when ``used`` is 0).
    """
    first = min(used, size - head)
    segments = [(head, head + first)] if first else []
    if used > first:
        segments.append((0, used - first))
    return segments


@njit(cache=True)
def _release(state, slot, alive, generation, free):
    alive[slot] = DEAD
    generation[slot] += 1
    free[state[FREE_TOP]] = slot
    state[FREE_TOP] += 1


@njit(cache=True)
def _evict_oldest(state, capacity, n_slots, length, generation, alive, order, free):
    slot = order[state[ORDER_HEAD]]
    steps = length[slot]
    state[STEP_HEAD] = (state[STEP_HEAD] + steps) % capacity
    state[STEPS_USED] -= steps
    state[ORDER_HEAD] = (state[ORDER_HEAD] + 1) % n_slots
    state[ORDER_COUNT] -= 1
    was_live = alive[slot] == LIVE
    if was_live:
        state[LIVE_COUNT] -= 1
        state[LIVE_STEPS] -= steps
        state[EVICTED_TOTAL] += 1
    _release(state, slot, alive, generation, free)
    return slot, was_live


@njit(cache=True, nogil=True)
def plan_insert(table, capacity, lengths, now, priorities, slots_out, evicted_out):
    """Reserve a slot of ``table`` and ring steps for each new trajectory, evicting the oldest (FIFO)
    as needed; ``now`` is the insertion stamp recorded for all of them and ``priorities`` their raw
    priorities (one each, or a single one shared by all: a 1-element array).

    Writes the new slots to ``slots_out`` and the slots of evicted live trajectories (their
    weights must be zeroed where the batch left them free) to the front of ``evicted_out``
    (int64, at least ``min(state[ORDER_COUNT], sum(lengths) + len(lengths))`` entries, a bound on the
    live evictions: each frees a slot or a missing step; the caller may reuse it
    from call to call, so that its pages are not committed anew), and returns their count. A slot
    evicted and at once taken back by the next new trajectory (the steady state of a full ring) is
    left out: it is live again, its weight to be overwritten.
    The caller has checked ``sum(lengths) <= capacity`` and ``len(lengths) <= n_slots``.
    Cost: O(n + evictions); no data is copied here. The counters live in locals for the
    loop (``state`` may alias the rows as far as the compiler knows, so every ``state[...]``
    would be a memory round trip) and the rings wrap by one compare instead of ``%``: the
    same table as :func:`_evict_oldest` per eviction, at about half the time.
    """
    start, length, priority, generation, seq, stamp, times_sampled, alive, order, free, state = table
    n_slots = order.shape[0]
    n = lengths.shape[0]
    step_head, steps_used = state[STEP_HEAD], state[STEPS_USED]
    order_head, order_count = state[ORDER_HEAD], state[ORDER_COUNT]
    free_top, next_fresh, next_seq = state[FREE_TOP], state[NEXT_FRESH], state[NEXT_SEQ]
    live_count, live_steps, evicted_total = state[LIVE_COUNT], state[LIVE_STEPS], state[EVICTED_TOTAL]
    evicted = evicted_out
    shared = priorities.shape[0] == 1
    n_evicted = 0
    for i in range(n):
        steps = lengths[i]
        while order_count > 0:
            # evict while there is no room; then release removed trajectories that reached the head
            if capacity - steps_used >= steps and order_count < n_slots and alive[order[order_head]] != REMOVED:
                break
            slot = order[order_head]
            old = length[slot]
            step_head += old
            if step_head >= capacity:
                step_head -= capacity
            steps_used -= old
            order_head += 1
            if order_head == n_slots:
                order_head = 0
            order_count -= 1
            if alive[slot] == LIVE:
                live_count -= 1
                live_steps -= old
                evicted_total += 1
                evicted[n_evicted] = slot
                n_evicted += 1
            alive[slot] = DEAD
            generation[slot] += 1
            free[free_top] = slot
            free_top += 1
        if free_top > 0:
            free_top -= 1
            slot = free[free_top]
            if n_evicted > 0 and evicted[n_evicted - 1] == slot:
                n_evicted -= 1  # an eviction taken back at once: its weight is overwritten anyway
        else:
            slot = next_fresh
            next_fresh += 1
        # rows that already hold the value are not rewritten (a full ring of equal-length items, in its
        # steady state, takes each slot back at the same step, length and order place): a clean cache
        # line (a clean page of a file-backed table) costs a read, a written one a read and a write-back
        pos = step_head + steps_used
        pos = pos - capacity if pos >= capacity else pos
        if start[slot] != pos:
            start[slot] = pos
        if length[slot] != steps:
            length[slot] = steps
        seq[slot] = next_seq
        stamp[slot] = now
        next_seq += 1
        if times_sampled[slot] != 0:
            times_sampled[slot] = 0
        alive[slot] = LIVE
        pos = order_head + order_count
        pos = pos - n_slots if pos >= n_slots else pos
        if order[pos] != slot:
            order[pos] = slot
        order_count += 1
        steps_used += steps
        live_count += 1
        live_steps += steps
        p = priorities[0] if shared else priorities[i]
        if priority[slot] != p:
            priority[slot] = p
        slots_out[i] = slot
    state[STEP_HEAD], state[STEPS_USED] = step_head, steps_used
    state[ORDER_HEAD], state[ORDER_COUNT] = order_head, order_count
    state[FREE_TOP], state[NEXT_FRESH], state[NEXT_SEQ] = free_top, next_fresh, next_seq
    state[LIVE_COUNT], state[LIVE_STEPS], state[EVICTED_TOTAL] = live_count, live_steps, evicted_total
    state[INSERTED_TOTAL] += n
    return n_evicted


@njit(cache=True)
def _trim_ends(state, capacity, length, generation, alive, order, free):
    """Release removed trajectories sitting at either end of the order ring, with their steps."""
    n_slots = order.shape[0]
    while state[ORDER_COUNT] > 0 and alive[order[state[ORDER_HEAD]]] == REMOVED:
        _evict_oldest(state, capacity, n_slots, length, generation, alive, order, free)
    while state[ORDER_COUNT] > 0:
        pos = (state[ORDER_HEAD] + state[ORDER_COUNT] - 1) % n_slots
        slot = order[pos]
        if alive[slot] != REMOVED:
            break
        state[STEPS_USED] -= length[slot]
        state[ORDER_COUNT] -= 1
        _release(state, slot, alive, generation, free)


@njit(cache=True)
def count_samples(table, capacity, slots, max_times):
    """Add one use to each sampled slot of ``table``; remove those that reached ``max_times`` (0 = never).

    Returns the removed slots (their weights must be zeroed). Cost: O(B) plus the
    trimmed ends.
    """
    start, length, priority, generation, seq, stamp, times_sampled, alive, order, free, state = table
    removed = np.empty(slots.shape[0], dtype=np.int64)
    k = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        times_sampled[s] += 1
        if max_times > 0 and times_sampled[s] >= max_times and alive[s] == LIVE:
            alive[s] = REMOVED
            state[LIVE_COUNT] -= 1
            state[LIVE_STEPS] -= length[s]
            state[REMOVED_TOTAL] += 1
            removed[k] = s
            k += 1
    if k > 0:
        _trim_ends(state, capacity, length, generation, alive, order, free)
    return removed[:k]


@njit(cache=True)
def live_in_order(state, alive, order, newest_first, limit):
    """Up to ``limit`` live slots in insertion order (or newest first). Cost: O(scanned)."""
    n_slots = order.shape[0]
    count = state[ORDER_COUNT]
    out = np.empty(min(limit, state[LIVE_COUNT]), dtype=np.int64)
    k = 0
    for j in range(count):
        if k == out.shape[0]:
            break
        pos = count - 1 - j if newest_first else j
        slot = order[(state[ORDER_HEAD] + pos) % n_slots]
        if alive[slot] == LIVE:
            out[k] = slot
            k += 1
    return out[:k]

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


@njit(cache=True)
def plan_insert(table, capacity, lengths, now, slots_out):
    """Reserve a slot of ``table`` and ring steps for each new trajectory, evicting the oldest (FIFO)
    as needed; ``now`` is the insertion stamp recorded for all of them.

    Writes the new slots to ``slots_out`` and returns the slots of evicted live
    trajectories (their weights must be zeroed before the new ones are set).
    The caller has checked ``sum(lengths) <= capacity`` and ``len(lengths) <= n_slots``.
    Cost: O(n + evictions); no data is copied here.
    """
    start, length, priority, generation, seq, stamp, times_sampled, alive, order, free, state = table
    n_slots = order.shape[0]
    evicted = np.empty(state[ORDER_COUNT] + lengths.shape[0], dtype=np.int64)
    n_evicted = 0
    for i in range(lengths.shape[0]):
        steps = lengths[i]
        while capacity - state[STEPS_USED] < steps or state[ORDER_COUNT] == n_slots:
            slot, was_live = _evict_oldest(state, capacity, n_slots, length, generation, alive, order, free)
            if was_live:
                evicted[n_evicted] = slot
                n_evicted += 1
        # a removed trajectory that eviction brought to the head releases its steps now
        while state[ORDER_COUNT] > 0 and alive[order[state[ORDER_HEAD]]] == REMOVED:
            _evict_oldest(state, capacity, n_slots, length, generation, alive, order, free)
        if state[FREE_TOP] > 0:
            state[FREE_TOP] -= 1
            slot = free[state[FREE_TOP]]
        else:
            slot = state[NEXT_FRESH]
            state[NEXT_FRESH] += 1
        start[slot] = (state[STEP_HEAD] + state[STEPS_USED]) % capacity
        length[slot] = steps
        seq[slot] = state[NEXT_SEQ]
        stamp[slot] = now
        state[NEXT_SEQ] += 1
        times_sampled[slot] = 0
        alive[slot] = LIVE
        order[(state[ORDER_HEAD] + state[ORDER_COUNT]) % n_slots] = slot
        state[ORDER_COUNT] += 1
        state[STEPS_USED] += steps
        state[LIVE_COUNT] += 1
        state[LIVE_STEPS] += steps
        state[INSERTED_TOTAL] += 1
        slots_out[i] = slot
    return evicted[:n_evicted]


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

"""Step ring and trajectory table bookkeeping (CPU kernels over the table arrays).

The table is one :class:`Table`: the per-slot rows ``start``, ``length``, ``status``,
``stamp`` and ``times_sampled``, a ring ``order`` of slots in insertion order, and
``state``, an int64 array of the counters below. Steps of live trajectories occupy
the ring contiguously in insertion order, so the oldest trajectory always sits at
``state[STEP_HEAD]``.

``status`` (uint16) packs two fields: its low ``keys.GEN_BITS`` bits are the slot's
generation (counted modulo ``2**GEN_BITS``, exactly the part a key carries), its top two
bits the alive code: ``DEAD`` (0, free or evicted), ``LIVE`` (1), ``REMOVED`` (2, removed by
``max_times_sampled`` but still holding its steps until it reaches an end of the order ring).
``status & GEN_MASK`` is the generation, ``status >> ALIVE_SHIFT`` the alive code.

Free slots form a stack linked through their ``start`` entries (unused while a slot is
free): ``state[FREE_HEAD]`` is the top, ``start[slot]`` the slot below, ``state[FREE_TOP]``
the count. The insertion sequence of a trajectory is not stored: it is its position in
the order ring (see :func:`seq_numbers`).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from ..keys import GEN_BITS, GEN_MASK, RANK_MASK, SLOT_MASK, TAG_MASK, _GEN_SHIFT, _RANK_SHIFT, _TAG_SHIFT

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
STATE_SIZE = 12  # the counters a checkpoint saves
FREE_HEAD = 12   # the free stack's top slot (rebuilt from the saved stack on restore)
STATE_LEN = 13   # the length of ``state``

DEAD = 0
LIVE = 1
REMOVED = 2

ALIVE_SHIFT = GEN_BITS  # status = alive << ALIVE_SHIFT | generation
assert GEN_BITS + 2 <= 16

# The rows a checkpoint stores per slot, in this order (see storage.TrajectoryStore.table_sections).
TABLE_ROWS = ("start", "length", "priority", "generation", "seq", "stamp", "times_sampled", "alive")
# The arrays of a Table, in this order everywhere.
TABLE_FIELDS = ("start", "length", "status", "stamp", "times_sampled", "order", "state")
Table = namedtuple("Table", TABLE_FIELDS)
Table.__doc__ = """The arrays of one trajectory table. Per slot: ``start`` (uint32, or int64 past 2**32
ring steps), ``length`` (the narrowest unsigned type holding ``max_length``), ``status`` (uint16: generation
and alive code), ``stamp`` (int64 insertion time, ns) and ``times_sampled`` (uint32 uses); ``order``
(int32 ring of slots); ``state`` (int64[STATE_LEN]). A row whose every value is known (``length`` when
every trajectory is one step, ``times_sampled`` when uses are not counted) is one element seen through a
zero stride. Built once by its store (:mod:`gear_mpi.storage.table`).

The kernels take it whole, as a ``Table`` or as the plain tuple of its arrays in
``TABLE_FIELDS`` order (``tuple(table)``, which the store passes: numba types a plain
tuple of arrays in its C dispatcher, a named tuple through Python, about 1 us a call),
and unpack it in that order; they compile once per combination of dtypes."""


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


@njit(cache=True, inline="always")
def alive_of(status, slot):
    """The alive code of ``slot`` (``DEAD``, ``LIVE`` or ``REMOVED``)."""
    return status[slot] >> ALIVE_SHIFT


@njit(cache=True, inline="always")
def _set_alive(status, slot, code):
    status[slot] = (status[slot] & GEN_MASK) | (code << ALIVE_SHIFT)


@njit(cache=True, nogil=True)
def _release(state, slot, start, status):
    # dead, next generation; pushed on the free stack linked through ``start``
    status[slot] = (status[slot] + 1) & GEN_MASK
    start[slot] = state[FREE_HEAD]
    state[FREE_HEAD] = slot
    state[FREE_TOP] += 1


@njit(cache=True, nogil=True)
def _evict_oldest(state, capacity, n_slots, start, length, status, order):
    slot = order[state[ORDER_HEAD]]
    steps = length[slot]
    state[STEP_HEAD] = (state[STEP_HEAD] + steps) % capacity
    state[STEPS_USED] -= steps
    state[ORDER_HEAD] = (state[ORDER_HEAD] + 1) % n_slots
    state[ORDER_COUNT] -= 1
    was_live = alive_of(status, slot) == LIVE
    if was_live:
        state[LIVE_COUNT] -= 1
        state[LIVE_STEPS] -= steps
        state[EVICTED_TOTAL] += 1
    _release(state, slot, start, status)
    return slot, was_live


@njit(cache=True, nogil=True)
def plan_insert(table, capacity, lengths, now, slots_out, evicted_out):
    """Reserve a slot of ``table`` and ring steps for each new trajectory, evicting the oldest (FIFO)
    as needed; ``now`` is the insertion stamp recorded for all of them (raw priorities, where the
    table keeps them, are the caller's to write).

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
    same table as :func:`_evict_oldest` per eviction, at about half the time. The last slot freed is
    held in a local rather than pushed on the free stack (pushed only when another is freed, or at the
    end): in a full ring the next trajectory takes it back at once, so its ``start`` entry is not
    overwritten with the stack link and then with its new start, which there is its old one (the row
    stays clean; 1e7 one-step items into a full ring: about 30 % less time in this kernel).
    """
    start, length, status, stamp, times_sampled, order, state = table
    n_slots = order.shape[0]
    n = lengths.shape[0]
    step_head, steps_used = state[STEP_HEAD], state[STEPS_USED]
    order_head, order_count = state[ORDER_HEAD], state[ORDER_COUNT]
    free_top, next_fresh, next_seq = state[FREE_TOP], state[NEXT_FRESH], state[NEXT_SEQ]
    free_head = state[FREE_HEAD]
    live_count, live_steps, evicted_total = state[LIVE_COUNT], state[LIVE_STEPS], state[EVICTED_TOTAL]
    evicted = evicted_out
    n_evicted = 0
    held = -1  # the last slot freed, not yet pushed: the next trajectory takes it back at once (a full ring)
    for i in range(n):
        steps = lengths[i]
        while order_count > 0:
            # evict while there is no room; then release removed trajectories that reached the head
            if capacity - steps_used >= steps and order_count < n_slots \
                    and (status[order[order_head]] >> ALIVE_SHIFT) != REMOVED:
                break
            slot = order[order_head]
            old = np.int64(length[slot])
            step_head += old
            if step_head >= capacity:
                step_head -= capacity
            steps_used -= old
            order_head += 1
            if order_head == n_slots:
                order_head = 0
            order_count -= 1
            st = status[slot]
            if (st >> ALIVE_SHIFT) == LIVE:
                live_count -= 1
                live_steps -= old
                evicted_total += 1
                evicted[n_evicted] = slot
                n_evicted += 1
            status[slot] = (st + 1) & GEN_MASK
            if held >= 0:
                start[held] = free_head
                free_head = held
            held = slot
            free_top += 1
        if free_top > 0:
            free_top -= 1
            if held >= 0:
                slot = held
                held = -1
            else:
                slot = free_head
                free_head = np.int64(start[slot])
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
        stamp[slot] = now
        next_seq += 1
        if times_sampled[slot] != 0:
            times_sampled[slot] = 0
        status[slot] = (status[slot] & GEN_MASK) | (LIVE << ALIVE_SHIFT)
        pos = order_head + order_count
        pos = pos - n_slots if pos >= n_slots else pos
        if order[pos] != slot:
            order[pos] = slot
        order_count += 1
        steps_used += steps
        live_count += 1
        live_steps += steps
        slots_out[i] = slot
    if held >= 0:
        start[held] = free_head
        free_head = held
    state[STEP_HEAD], state[STEPS_USED] = step_head, steps_used
    state[ORDER_HEAD], state[ORDER_COUNT] = order_head, order_count
    state[FREE_TOP], state[NEXT_FRESH], state[NEXT_SEQ] = free_top, next_fresh, next_seq
    state[FREE_HEAD] = free_head
    state[LIVE_COUNT], state[LIVE_STEPS], state[EVICTED_TOTAL] = live_count, live_steps, evicted_total
    state[INSERTED_TOTAL] += n
    return n_evicted


@njit(cache=True, nogil=True)
def _trim_ends(state, capacity, start, length, status, order):
    """Release removed trajectories sitting at either end of the order ring, with their steps."""
    n_slots = order.shape[0]
    while state[ORDER_COUNT] > 0 and alive_of(status, order[state[ORDER_HEAD]]) == REMOVED:
        _evict_oldest(state, capacity, n_slots, start, length, status, order)
    while state[ORDER_COUNT] > 0:
        pos = (state[ORDER_HEAD] + state[ORDER_COUNT] - 1) % n_slots
        slot = order[pos]
        if alive_of(status, slot) != REMOVED:
            break
        state[STEPS_USED] -= length[slot]
        state[ORDER_COUNT] -= 1
        _release(state, slot, start, status)


@njit(cache=True, nogil=True)
def clear_all(table, capacity):
    """Remove every trajectory of ``table``: each live one counts as removed, every slot is released (dead, next
    generation: its keys go stale) and the ring's steps are freed. Returns the slots that were live (their index
    weights must be zeroed). Cost: O(trajectories in the order ring), one pass."""
    start, length, status, stamp, times_sampled, order, state = table
    n_slots = order.shape[0]
    live = np.empty(state[LIVE_COUNT], dtype=np.int64)
    k = 0
    while state[ORDER_COUNT] > 0:
        slot = order[state[ORDER_HEAD]]
        if alive_of(status, slot) == LIVE:
            _set_alive(status, slot, REMOVED)
            state[LIVE_COUNT] -= 1
            state[LIVE_STEPS] -= length[slot]
            state[REMOVED_TOTAL] += 1
            live[k] = slot
            k += 1
        _evict_oldest(state, capacity, n_slots, start, length, status, order)
    return live[:k]


@njit(cache=True, nogil=True)
def count_samples(table, capacity, slots, max_times):
    """Add one use to each sampled slot of ``table``; remove those that reached ``max_times`` (> 0).

    Returns the removed slots (their weights must be zeroed). Cost: O(B) plus the
    trimmed ends. (A table that does not count uses never calls it: see the store.)
    """
    start, length, status, stamp, times_sampled, order, state = table
    removed = np.empty(slots.shape[0], dtype=np.int64)
    k = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        times_sampled[s] += 1
        if times_sampled[s] >= max_times and alive_of(status, s) == LIVE:
            _set_alive(status, s, REMOVED)
            state[LIVE_COUNT] -= 1
            state[LIVE_STEPS] -= length[s]
            state[REMOVED_TOTAL] += 1
            removed[k] = s
            k += 1
    if k > 0:
        _trim_ends(state, capacity, start, length, status, order)
    return removed[:k]


@njit(cache=True, nogil=True)
def live_in_order(state, status, order, newest_first, limit):
    """Up to ``limit`` live slots in insertion order (or newest first). Cost: O(scanned).

    ``status`` is the table's status row (``store.status``; ``store.alive`` names the same array)."""
    n_slots = order.shape[0]
    count = state[ORDER_COUNT]
    out = np.empty(min(limit, state[LIVE_COUNT]), dtype=np.int64)
    k = 0
    for j in range(count):
        if k == out.shape[0]:
            break
        pos = count - 1 - j if newest_first else j
        slot = order[(state[ORDER_HEAD] + pos) % n_slots]
        if alive_of(status, slot) == LIVE:
            out[k] = slot
            k += 1
    return out[:k]


@njit(cache=True, nogil=True)
def free_stack(state, start):
    """The free slots, bottom of the stack first (as a saved ``free`` section lists them). O(free)."""
    n = state[FREE_TOP]
    out = np.empty(n, np.int64)
    slot = state[FREE_HEAD]
    for i in range(n - 1, -1, -1):
        out[i] = slot
        slot = start[slot]
    return out


@njit(cache=True, nogil=True)
def link_free(state, start, free):
    """Make ``free`` (bottom first) the free stack, linked through ``start``. O(free)."""
    below = -1
    for i in range(free.shape[0]):
        s = free[i]
        if below >= 0:
            start[s] = below
        below = s
    state[FREE_TOP] = free.shape[0]
    state[FREE_HEAD] = below if below >= 0 else 0


@njit(cache=True, nogil=True)
def resolve_keys(keys, tag, rank, max_items, status, slots, live):
    """Slots of this shard's keys and whether each is live. O(B), one pass.

    A key is live when its slot's alive code is ``LIVE`` and its generation matches the slot's.

    Args:
        keys: int64 keys.
        tag: this replay's key tag.
        rank: this shard's rank.
        max_items: this shard's slots.
        status: the table's status row.
        slots: an int64 array of ``len(keys)`` to fill with each key's slot.
        live: a bool array of ``len(keys)`` to fill with each key's liveness.

    Returns:
        The index of the first key that is not this shard's (negative, out of range, another tag or
        rank), or -1; nothing is filled past it.
    """
    want = LIVE << ALIVE_SHIFT
    for i in range(keys.shape[0]):
        k = keys[i]
        s = k & SLOT_MASK
        if k < 0 or ((k >> _TAG_SHIFT) & TAG_MASK) != tag or ((k >> _RANK_SHIFT) & RANK_MASK) != rank \
                or s >= max_items:
            return i
        slots[i] = s
        live[i] = status[s] == (want | ((k >> _GEN_SHIFT) & GEN_MASK))
    return -1


@njit(cache=True, nogil=True)
def seq_numbers(state, order, hwm):
    """Each slot's insertion sequence number, derived from its place in the order ring (0 for slots not in
    it); the newest has ``state[NEXT_SEQ] - 1``. O(hwm)."""
    out = np.zeros(hwm, np.int64)
    n_slots = order.shape[0]
    count = state[ORDER_COUNT]
    base = state[NEXT_SEQ] - count
    for j in range(count):
        out[order[(state[ORDER_HEAD] + j) % n_slots]] = base + j
    return out

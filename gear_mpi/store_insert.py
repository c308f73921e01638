"""The fast path of a batch insert: a store's table pass and column copies, and the index's leaves.

:func:`insert` is :meth:`TrajectoryStore.insert <gear_mpi.storage.TrajectoryStore.insert>`'s body:
one :func:`ring.plan_insert <gear_mpi.kernels.ring.plan_insert>` pass (slots, evictions and
priorities, written into an :class:`InsertScratch` the store keeps), then one copy per column (two
where the ring wraps). :func:`set_inserted_leaves` is the host index's part of a large insert: zero the
evicted slots the batch did not reuse, write the new weights (the caller then rebuilds the levels).

Why a scratch: a 1e7-item insert needs 160 MB for its slots and evictions; a fresh array per call
committed those pages anew each time (on this VM that alone moved a warm insert between 0.42 and
0.78 s). Local: no communication. The code reads the table's arrays whatever their dtypes.
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit

from .kernels import ring


class InsertScratch:
    """A grow-only int64 buffer a store reuses from insert to insert (new slots, then evictions).

    Memory: 8 bytes per entry, grown to the largest need seen (by doubling at least), kept until
    :meth:`drop`. Not thread-safe (nor is the store).
    """

    def __init__(self) -> None:
        self.buffer = np.zeros(0, np.int64)

    def take(self, need: int) -> np.ndarray:
        """At least ``need`` entries (a view of the buffer; valid until the next call).

        Args:
            need: the entries wanted (>= 0).
        Returns:
            An int64 array of ``need`` entries or more, contents undefined. O(1) unless it grows.
        """
        if len(self.buffer) < need:
            self.buffer = np.empty(max(need, 2 * len(self.buffer)), np.int64)
        return self.buffer

    def drop(self) -> None:
        """Release the buffer (the store closes). O(1)."""
        self.buffer = np.zeros(0, np.int64)


def insert(store, columns, lengths: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Store already-validated trajectories laid end to end in ``store`` (a
    :class:`~gear_mpi.storage.TrajectoryStore`), evicting the oldest (FIFO) to make room.

    Args:
        store: the store; the caller has passed the batch through its ``check_batch``.
        columns: column name -> all the batch's steps, back to back, of a dtype that casts to the column's.
        lengths: int64 steps of each trajectory (C-contiguous).
        priorities: the raw priority of each (float64), or one shared by all as a stride-0 array.
    Returns:
        (slots of the new trajectories, slots of the live trajectories evicted): views of the store's
        scratch, valid until its next insert.
    Cost: one table pass in a kernel (O(n + evictions)), one copy per column (at most two slices, for the
    ring's wrap-around, the dtype cast inside the copy); no allocation once the scratch is large enough.
    """
    n = len(lengths)
    total = int(lengths.sum())
    # the slots, then room for every live eviction: never more than the trajectories stored, nor more than
    # one per new item plus one per new step (each eviction frees a slot or at least one step)
    need = n + min(int(store.state[ring.ORDER_COUNT]), total + n)
    scratch = store._insert_scratch.take(need)
    if n and priorities.strides == (0,):
        priorities = priorities[:1]
    n_evicted = ring.plan_insert(store._arrays, store.capacity, lengths, time.time_ns(), scratch[:n], scratch[n:need])
    slots, evicted = scratch[:n], scratch[n:n + n_evicted]
    if store.priority is not None:  # raw priorities, where the table keeps them (see table_layout)
        store.priority[slots] = priorities
    first = int(store.start[slots[0]])
    head = min(total, store.capacity - first)
    for name, data in columns.items():
        dst = store.columns[name]
        dst[first:first + head] = data[:head]
        if head < total:
            dst[:total - head] = data[head:]
    return slots, evicted


@njit(cache=True, nogil=True)
def set_inserted_leaves(leaves, slots, weights, evicted, status, alive_shift, dead):
    """Write a batch's weights into an index's ``leaves`` and zero the evicted slots it did not reuse;
    return how many leaves changed (none: the levels above need no rebuild).

    Args:
        leaves: the index's leaf weights (written in place; the levels above are not touched: rebuild them).
        slots: the new trajectories' slots.
        weights: their weights, one each, or one shared by all (a 1-element array).
        evicted: the slots of the live trajectories the batch evicted.
        status: the store's ``status`` row (after the insert), its alive code above ``alive_shift`` bits;
            ``dead``: the code of a free slot.
    Cost: O(n + evictions), one pass each; no temporary. A leaf that already holds its value is not
    rewritten (its cache line stays clean).
    """
    changed = 0
    for i in range(evicted.shape[0]):
        e = evicted[i]
        if (status[e] >> alive_shift) == dead and leaves[e] != 0.0:
            leaves[e] = 0.0
            changed += 1
    shared = weights.shape[0] == 1
    for i in range(slots.shape[0]):
        w = weights[0] if shared else weights[i]
        if leaves[slots[i]] != w:
            leaves[slots[i]] = w
            changed += 1
    return changed

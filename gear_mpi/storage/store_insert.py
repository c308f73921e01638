"""The parts of a batch insert that need no store: the chunk bounds, the eviction scratch, the column-copy
thread, and the kernels writing raw priorities and the index's leaves.

:meth:`TrajectoryStore.insert_chunked <gear_mpi.storage.store.TrajectoryStore.insert_chunked>` is the body
of every shard insert: :func:`ring.plan_insert <gear_mpi.kernels.ring.plan_insert>` over chunks of at most
:data:`CHUNK_ITEMS` trajectories (:func:`chunk_end`; the new slots written straight into the caller's
output, the evictions of each chunk, at most :func:`eviction_bound`, into an :class:`InsertScratch` the
store keeps, handed to the caller's ``on_evicted`` before the next chunk), then one copy per column (two
where the ring wraps; in a :class:`ColumnCopies` thread, alongside the table pass, for a batch of
:data:`OVERLAP_BYTES` or more, in pieces of about :data:`PIECE_BYTES`). :func:`set_priorities` writes a
chunk's raw priorities, :func:`set_inserted_leaves` and :func:`zero_evicted_leaves` are the host index's
part of a large insert, :func:`mapped_empty` the keys' array.

Why chunks and a scratch of its own: a 1e7-item insert used to take 160 MB of slots and evictions
(kept by the store: 8-16 B per item for good) and every insert left its n-sized temporaries
(validated priorities, weights) to glibc's heap, which kept them resident (its mmap threshold rises
with the first big free, so later ones of up to 32 MB come from the heap and stay): 7 B per item at
N=1e7 filled in chunks of 1e6 (scripts/bench/bench_memory.py). Chunked, the scratch is bounded
(:data:`SCRATCH_ENTRIES`, 2 MB) and reused, and taken from an anonymous mapping: never from malloc,
so glibc's threshold and heap do not move, and returned to the system when the store closes. Local:
no communication. The code reads the table's arrays whatever their dtypes.
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np
from numba import njit

from ..kernels import ring
from ..kernels.priority_tree import leaf_value
from .arenas import anonymous_pages, commit_pages
from .file_arenas import close_mapping

CHUNK_ITEMS = 1 << 17  # trajectories per table pass (and per weights temporary: 1 MB of float64)
SCRATCH_ENTRIES = 1 << 18  # eviction entries a chunk may need (2 MB): a chunk ends before its bound passes it


class InsertScratch:
    """A grow-only int64 buffer a store reuses from insert to insert (a chunk's evictions).

    Memory: 8 bytes per entry, grown to the largest need seen (by doubling at least; at most
    ``SCRATCH_ENTRIES`` unless one trajectory alone could evict more), in an anonymous private
    mapping (not the C heap: released to the system by :meth:`drop` or when it grows), committed
    only where written. Not thread-safe (nor is the store).
    """

    def __init__(self) -> None:
        self._map = None
        self.buffer = np.zeros(0, np.int64)

    def take(self, need: int) -> np.ndarray:
        """At least ``need`` entries (a view of the buffer; valid until the next call).

        Args:
            need: the entries wanted (>= 0).
        Returns:
            An int64 array of ``need`` entries or more, contents undefined. O(1) unless it grows
            (one mmap; the old mapping is unmapped).
        """
        if len(self.buffer) < need:
            size = max(need, 2 * len(self.buffer), 512)
            new_map = anonymous_pages(size * 8, huge=False)
            self.drop()
            self._map = new_map
            self.buffer = np.frombuffer(new_map, np.int64)
        return self.buffer

    def drop(self) -> None:
        """Release the buffer (the store closes). O(1). Views handed out before must not be used."""
        self.buffer = np.zeros(0, np.int64)
        close_mapping(self._map)  # a view still alive somewhere: the mapping goes with it
        self._map = None


def mapped_empty(count: int, dtype=np.int64) -> np.ndarray:
    """A new array of ``count`` entries: from an anonymous mapping when it is 1 MiB or more (freeing it
    unmaps it), else from numpy's allocator. For the keys an insert returns: a big one from the C heap
    would raise glibc's mmap threshold when freed, and the next ones of that size would then stay in
    the heap once freed. Cost: one mmap (pages committed when written).
    """
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes < 1 << 20:
        return np.empty(count, dtype)
    return np.frombuffer(anonymous_pages(nbytes, huge=False), dtype)


def eviction_bound(state: np.ndarray, n_slots: int, capacity: int, n: int, steps: int) -> int:
    """A bound on the live trajectories an insert of ``n`` trajectories of ``steps`` steps evicts.

    ``plan_insert`` evicts only while the next trajectory lacks an order place or ring steps, and
    every eviction frees one place and at least one step: the evictions are at most the places
    missing plus the steps missing (and at most the trajectories stored). 0 while the ring fills.
    Args:
        state: the store's ``state`` row (before the insert).
        n_slots: table slots; capacity: ring steps; n, steps: the batch's trajectories and steps.
    Returns:
        The bound (>= 0). O(1).
    """
    count = int(state[ring.ORDER_COUNT])
    short = max(0, count + n - n_slots) + max(0, int(state[ring.STEPS_USED]) + steps - capacity)
    return min(count, short)


@njit(cache=True, nogil=True)
def chunk_end(lengths, lo, max_items, max_entries):
    """(the end of the chunk starting at ``lo``, its steps): at most ``max_items`` trajectories whose
    count plus steps stays within ``max_entries`` (at least one trajectory). One pass over the chunk."""
    hi = lo
    used = 0
    n = lengths.shape[0]
    while hi < n and hi - lo < max_items:
        cost = 1 + lengths[hi]
        if hi > lo and used + cost > max_entries:
            break
        used += cost
        hi += 1
    return hi, used - (hi - lo)


OVERLAP_BYTES = 32 << 20  # a batch of at least this many step bytes copies its columns in a thread of its own
PIECE_BYTES = 16 << 20  # a large batch's copies go in pieces of about this many bytes, taken by either thread


class ColumnCopies(threading.Thread):
    """The column copies of one large batch, in pieces, in a thread of their own (the inserting thread
    takes the pieces left once it has planned the table: :meth:`copy_pieces`; started here, joined by
    :meth:`result`: no thread outlives the insert, so a later ``fork`` finds none). Done copying, it
    commits the pages of ``slots_out`` (the keys returned: a fresh 80 MB at 1e7 items) that the table
    pass has not reached yet, which that pass would otherwise fault in one by one (1e7 one-step items,
    warm, ten alternating pairs in one process: 308 ms median against 320, faster in 9 pairs of 10),
    and then finishes the chunks the table pass hands it (:meth:`hand`: raw priorities, index leaves,
    keys; ``finish(lo, hi)``), in order, while that pass plans the next ones.

    Args:
        pieces: (destination, source, commit first) triples (``TrajectoryStore._copy_pieces``).
        slots_out: the keys' array to commit once copied (None: none).
        finish: called with each chunk handed, in order.
    """

    def __init__(self, pieces: list[tuple[np.ndarray, np.ndarray, bool]], slots_out: np.ndarray | None = None,
                 finish: Callable[[int, int], None] | None = None):
        super().__init__(name="gear_mpi_insert_copy", daemon=True)
        self.pieces = pieces
        self.taken = 0
        self.take = threading.Lock()
        self.slots_out = slots_out
        self.finish = finish
        self.chunks: list[tuple[int, int]] = []
        self.more = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.start()

    def hand(self, lo: int, hi: int) -> None:
        """Queue chunk ``lo:hi`` (planned) for ``finish``. O(1)."""
        with self.more:
            self.chunks.append((lo, hi))
            self.more.notify()

    def copy_pieces(self) -> None:
        """Copy pieces not yet taken by either thread, until none is left (the inserting thread calls it
        once the table is planned: a cold ring's fresh pages, faulted by two threads, took 0.69-0.88 s
        against 1.70-2.08 s by one for 640 MB of huge pages here). Raises what a copy raises."""
        while True:
            with self.take:
                i = self.taken
                self.taken += 1
            if i >= len(self.pieces):
                return
            dst, src, commit = self.pieces[i]
            if commit:
                commit_pages(dst)
            dst[...] = src

    def run(self) -> None:
        try:
            self.copy_pieces()
            if self.slots_out is not None:
                commit_pages(self.slots_out)
            done = 0
            while True:
                with self.more:
                    while len(self.chunks) == done and not self.closed:
                        self.more.wait()
                    todo = self.chunks[done:]
                if not todo:
                    return
                for lo, hi in todo:
                    self.finish(lo, hi)
                done += len(todo)
        except BaseException as e:  # re-raised in the inserting thread
            self.error = e

    def result(self) -> None:
        """No more chunks: wait for the copies and the chunks handed; raise what they raised."""
        with self.more:
            self.closed = True
            self.more.notify()
        self.join()
        self.pieces = self.slots_out = self.finish = None
        if self.error is not None:
            raise self.error


@njit(cache=True, nogil=True)
def set_priorities(row, slots, priorities):
    """``row[slots[i]] = priorities[i] + 0.0`` (-0.0 stored as +0.0), or the one value of a 1-element
    ``priorities`` for every slot; an entry that already holds its value is not rewritten (a full ring
    reinserted at one priority leaves the row's cache lines clean). O(n), no temporary."""
    shared = priorities.shape[0] == 1
    for i in range(slots.shape[0]):
        v = (priorities[0] if shared else priorities[i]) + 0.0
        if row[slots[i]] != v:
            row[slots[i]] = v


@njit(cache=True, nogil=True)
def zero_evicted_leaves(leaves, evicted, status, alive_shift, dead):
    """Zero the leaves of the ``evicted`` slots still free (``status``'s alive code, above
    ``alive_shift`` bits, ``dead``); return how many changed. O(evictions), no temporary; the levels
    above are not touched (rebuild them)."""
    changed = 0
    for i in range(evicted.shape[0]):
        e = evicted[i]
        if (status[e] >> alive_shift) == dead and leaves[e] != 0.0:
            leaves[e] = 0.0
            changed += 1
    return changed


@njit(cache=True, nogil=True)
def set_inserted_leaves(leaves, slots, weights, evicted, status, alive_shift, dead):
    """Write a batch's weights into an index's ``leaves`` and zero the evicted slots it did not reuse;
    return how many leaves changed (none: the levels above need no rebuild).

    Args:
        leaves: the index's leaf weights (written in place; the levels above are not touched: rebuild them).
        slots: the new trajectories' slots.
        weights: their weights, one each, or one shared by all (a 1-element array); each leaf holds
            its weight's ``priority_tree.leaf_value`` (rounded to float32), as ``PriorityIndex.set`` writes it.
        evicted: the slots of the live trajectories the batch evicted.
        status: the store's ``status`` row (after the insert), its alive code above ``alive_shift`` bits;
            ``dead``: the code of a free slot.
    Cost: O(n + evictions), one pass each; no temporary. A leaf that already holds its value is not
    rewritten (its cache line stays clean).
    """
    changed = zero_evicted_leaves(leaves, evicted, status, alive_shift, dead)
    shared = weights.shape[0] == 1
    for i in range(slots.shape[0]):
        w = leaf_value(weights[0] if shared else weights[i])
        if leaves[slots[i]] != w:
            leaves[slots[i]] = w
            changed += 1
    return changed

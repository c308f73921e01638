"""The fast path of a batch insert: a store's table pass and column copies, and the index's leaves.

:func:`insert_chunked` is the body of every shard insert: :func:`ring.plan_insert
<gear_mpi.kernels.ring.plan_insert>` over chunks of at most :data:`CHUNK_ITEMS` trajectories (the new
slots written straight into the caller's output, the evictions of each chunk into an
:class:`InsertScratch` the store keeps, handed to the caller's ``on_evicted`` before the next chunk),
then one copy per column (two where the ring wraps; in a thread of its own, alongside the table
pass, for a large batch). :func:`insert` is the older one-call form
(:meth:`TrajectoryStore.insert <gear_mpi.storage.store.TrajectoryStore.insert>`).
:func:`set_inserted_leaves` is the host index's part of a large insert.

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
import time
from typing import Callable

import numpy as np
from numba import njit

from ..kernels import ring
from .arenas import anonymous_pages, commit_pages, small_pages

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
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
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
def _chunk_end(lengths, lo, max_items, max_entries):
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


def insert_chunked(store, columns, lengths: np.ndarray, priorities: np.ndarray, slots_out: np.ndarray,
                   on_evicted: Callable[[np.ndarray], None] | None = None, steps: int | None = None,
                   after_chunk: Callable[[int, int], None] | None = None) -> int:
    """Store already-validated trajectories laid end to end in ``store`` (a
    :class:`~gear_mpi.storage.store.TrajectoryStore`), evicting the oldest (FIFO) to make room, the table
    planned chunk by chunk (the same table as one pass: the chunks are planned in order, with one stamp).

    Args:
        store: the store; the caller has passed the batch through its ``check_batch``.
        columns: column name -> all the batch's steps, back to back, of a dtype that casts to the column's.
        lengths: int64 steps of each trajectory (C-contiguous).
        priorities: the raw priority of each (float64), or one shared by all as a stride-0 array.
        slots_out: int64, C-contiguous, ``len(lengths)`` entries: receives the new slots.
        on_evicted: called after each chunk's table pass with the slots of the live trajectories it
            evicted (a view of the scratch, valid during the call; the status row already says which
            the chunk took back); a large batch's columns may be being written meanwhile.
        steps: ``lengths.sum()`` where the caller has it (None: summed here).
        after_chunk: called with ``(lo, hi)`` once trajectories ``lo:hi`` are planned (and their raw
            priorities written and ``on_evicted`` call made), chunk after chunk, soon enough that
            ``slots_out[lo:hi]`` is mostly still cached; for a large batch in the copy thread, alongside
            the planning of later chunks and their ``on_evicted`` calls, so it may touch only what belongs
            to these slots. Later chunks never evict or retake them (a batch fits the store): their slots
            and generations are final.
    Returns:
        The live trajectories evicted in all.
    Cost: one table pass in a kernel (O(n + evictions)) in chunks of ``CHUNK_ITEMS``, one copy per
    column (at most two slices, for the ring's wrap-around, the dtype cast inside the copy); no
    allocation once the scratch is large enough (it is bounded). A batch of :data:`OVERLAP_BYTES` or
    more copies its columns in a thread started for it (numpy's copy and the table kernel both
    release the GIL) while this thread plans the table: the two overlap on two cores (1e7 one-step items, warm:
    0.33-0.39 s -> 0.23-0.26 s here); that thread then writes the raw priorities and runs ``after_chunk``
    of the chunks planned, while this one plans the next. The copies go in pieces (:data:`PIECE_BYTES`):
    this thread, done planning, copies those still left (a cold ring's fresh pages: 1e7 one-step items,
    first insert 1.97-2.35 s -> 1.59-1.71 s here). All of it ends before this returns, or raises.
    """
    total = int(lengths.sum()) if steps is None else int(steps)
    shared = priorities.strides == (0,)
    now = time.time_ns()
    # the batch's steps go to the ring's tail, where the table pass will put them: evictions take steps
    # from the head only, so the tail is known now and the copies can run while the table is planned
    first = int(store.state[ring.STEP_HEAD] + store.state[ring.STEPS_USED]) % store.capacity
    # raw priorities, where the table keeps them and its row does not stand for them already
    keeps_priorities = isinstance(store.priority, np.ndarray) and store.layout.keep_priorities(priorities)

    def finish_chunk(lo: int, hi: int) -> None:  # after the chunk's plan: touches its slots' rows only
        if keeps_priorities:
            set_priorities(store.priority, slots_out[lo:hi], priorities[:1] if shared else priorities[lo:hi])
        if after_chunk is not None:
            after_chunk(lo, hi)

    fresh = total * store.spec.step_bytes >= OVERLAP_BYTES and reaches_fresh(store, first + total)
    with small_pages(fresh_arrays(store) if fresh else ()) as pages:
        evicted_all = _insert_chunks(store, columns, lengths, priorities, slots_out, on_evicted, first, total, now,
                                     finish_chunk, fresh)
    store.ring_touched = store.capacity if first + total >= store.capacity else max(store.ring_touched, first + total)
    if pages.maps:  # 4 KiB pages were committed: merged into huge pages now, in the background (opt-in)
        store.collapse_written()
    return evicted_all


def written_ranges(store) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of what inserts have written so far: each column's ring steps from 0 to
    ``ring_touched`` and each table row's slots below the first never used (``ring.NEXT_FRESH``). O(columns)."""
    steps, slots = min(store.ring_touched, store.capacity), int(store.state[ring.NEXT_FRESH])
    out = [(c.ctypes.data, steps * c.strides[0]) for c in store.columns.values()]
    out += [(a.ctypes.data, slots * a.strides[0]) for a in store.layout.written_rows()]
    return out


def reaches_fresh(store, end: int) -> bool:
    """Whether an insert whose steps end at ring step ``end`` (unwrapped) may write memory never written
    before: ring steps past ``store.ring_touched`` or table slots never used. O(1)."""
    return end > store.ring_touched or int(store.state[ring.NEXT_FRESH]) < store.max_items


def fresh_arrays(store) -> list[np.ndarray]:
    """The arrays a large first fill commits: the column arena and the table's rows (the raw priorities'
    too, where kept): what :class:`~gear_mpi.storage.arenas.small_pages` advises. O(1)."""
    return ([] if store.arena is None else [store.arena.buffer]) + store.layout.written_rows()


def _insert_chunks(store, columns, lengths, priorities, slots_out, on_evicted, first, total, now, finish_chunk,
                   fresh: bool = False) -> int:
    """:func:`insert_chunked`'s table pass and copies (its arguments, the tail ``first`` and the stamp
    ``now`` computed; ``fresh``: it reaches memory never written, committed ahead of the writes: the
    copies' pieces in the copy thread, each chunk's table rows and slots in this one). Returns the live
    trajectories evicted."""
    n = len(lengths)
    copying = _start_copies(store, columns, first, total, slots_out, finish_chunk,
                            store.ring_touched if fresh else None)
    rows = [a for a in store.table if a.strides[0] and len(a) == store.max_items and a is not store.order] \
        if fresh else []
    evicted_all = 0
    try:
        lo = 0
        while lo < n:
            hi, part_steps = _chunk_end(lengths, lo, CHUNK_ITEMS, SCRATCH_ENTRIES)
            part = lengths[lo:hi]
            need = eviction_bound(store.state, store.max_items, store.capacity, hi - lo, int(part_steps))
            evicted = store._insert_scratch.take(need)
            if rows:
                _commit_chunk_rows(store, rows, slots_out[lo:hi])
            k = ring.plan_insert(store._arrays, store.capacity, part, now, slots_out[lo:hi], evicted[:need])
            evicted_all += k
            if k and on_evicted is not None:
                on_evicted(evicted[:k])
            if copying is not None:
                copying.hand(lo, hi)
            else:
                finish_chunk(lo, hi)
            lo = hi
        if copying is not None:
            copying.copy_pieces()  # the table planned: help with the copies left (a cold ring's fresh pages)
    finally:  # the copies run on while the table is planned: they end before this returns or raises
        if copying is not None:
            copying.result()
    if copying is None:
        _copy_columns(store, columns, first, total)
    return evicted_all


def _commit_chunk_rows(store, rows: list[np.ndarray], slots: np.ndarray) -> None:
    """Commit the pages the table pass of a chunk of ``len(slots)`` trajectories is about to write for the
    first time (:func:`~gear_mpi.storage.arenas.commit_pages`: cheaper than faulting them in one by one): its
    never-used slots' entries of ``rows`` (slots are taken from the free stack first, then from the
    high-water mark up), its places in the order ring, and ``slots`` (the keys out). O(pages)."""
    k = len(slots)
    hwm = int(store.state[ring.NEXT_FRESH])
    fresh = min(k, store.max_items - hwm)
    if fresh <= 0:
        return
    for row in rows:
        commit_pages(row[hwm:hwm + fresh])
    tail = int(store.state[ring.ORDER_HEAD] + store.state[ring.ORDER_COUNT]) % store.max_items
    commit_pages(store.order[tail:tail + k])
    commit_pages(slots)


OVERLAP_BYTES = 32 << 20  # a batch of at least this many step bytes copies its columns in a thread of its own


def _copy_columns(store, columns, first: int, total: int) -> None:
    """Copy ``total`` steps of ``columns`` into ``store``'s ring from step ``first`` (wrapping around),
    piece by piece (:func:`_copy_pieces`) in this thread."""
    for dst, src, _ in _copy_pieces(store, columns, first, total):
        dst[...] = src


PIECE_BYTES = 16 << 20  # a large batch's copies go in pieces of about this many bytes, taken by either thread


def _copy_pieces(store, columns, first: int, total: int,
                 fresh_from: int | None = None) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """The copies of ``total`` steps of ``columns`` into ``store``'s ring from step ``first`` (wrapping
    around), as (destination, source, commit first) triples of about :data:`PIECE_BYTES` each: a piece
    reaching ring steps from ``fresh_from`` on (never written; None: none is) has its pages committed
    before it is copied (:func:`~gear_mpi.storage.arenas.commit_pages`)."""
    head = min(total, store.capacity - first)
    pieces = []
    for name, data in columns.items():
        dst = store.columns[name]
        step = max(1, PIECE_BYTES // max(1, dst[:1].nbytes))
        for a, b, at in ((0, head, first), (head, total, first - store.capacity)):
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                pieces.append((dst[at + lo:at + hi], data[lo:hi], fresh_from is not None and at + hi > fresh_from))
    return pieces


class _Copies(threading.Thread):
    """The column copies of one large batch, in pieces, in a thread of their own (the inserting thread
    takes the pieces left once it has planned the table: :meth:`copy_pieces`; started here, joined by
    :meth:`result`: no thread outlives the insert, so a later ``fork`` finds none). Done copying, it
    commits the pages of ``slots_out`` (the keys returned: a fresh 80 MB at 1e7 items) that the table
    pass has not reached yet, which that pass would otherwise fault in one by one (1e7 one-step items,
    warm, ten alternating pairs in one process: 308 ms median against 320, faster in 9 pairs of 10),
    and then finishes the chunks the table pass hands it (:meth:`hand`: raw priorities, index leaves,
    keys; ``finish(lo, hi)``), in order, while that pass plans the next ones."""

    def __init__(self, store, columns, first: int, total: int, slots_out: np.ndarray | None = None,
                 finish: Callable[[int, int], None] | None = None, fresh_from: int | None = None):
        super().__init__(name="gear_mpi_insert_copy", daemon=True)
        self.pieces = _copy_pieces(store, columns, first, total, fresh_from)
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


def _start_copies(store, columns, first: int, total: int, slots_out: np.ndarray | None = None,
                  finish: Callable[[int, int], None] | None = None, fresh_from: int | None = None) -> _Copies | None:
    """The column copies of a large batch started in a thread (then ``slots_out``'s pages committed and
    the chunks handed to it finished by ``finish``; pieces reaching ring step ``fresh_from`` committed
    before they are copied), or None (a small batch: the caller does all)."""
    if total * store.spec.step_bytes < OVERLAP_BYTES:
        return None
    return _Copies(store, columns, first, total, slots_out, finish, fresh_from)


def insert(store, columns, lengths: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`insert_chunked` in one call, for :meth:`TrajectoryStore.insert
    <gear_mpi.storage.store.TrajectoryStore.insert>`: the same arguments but ``slots_out`` and ``on_evicted``.

    Returns:
        (slots of the new trajectories, slots of the live trajectories evicted): new arrays.
    Cost: as :func:`insert_chunked`, plus the two arrays returned.
    """
    slots = np.empty(len(lengths), np.int64)
    gone: list[np.ndarray] = []
    insert_chunked(store, columns, lengths, priorities, slots, lambda e: gone.append(e.copy()))
    return slots, (np.concatenate(gone) if gone else np.zeros(0, np.int64))


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
        weights: their weights, one each, or one shared by all (a 1-element array).
        evicted: the slots of the live trajectories the batch evicted.
        status: the store's ``status`` row (after the insert), its alive code above ``alive_shift`` bits;
            ``dead``: the code of a free slot.
    Cost: O(n + evictions), one pass each; no temporary. A leaf that already holds its value is not
    rewritten (its cache line stays clean).
    """
    changed = zero_evicted_leaves(leaves, evicted, status, alive_shift, dead)
    shared = weights.shape[0] == 1
    for i in range(slots.shape[0]):
        w = weights[0] if shared else weights[i]
        if leaves[slots[i]] != w:
            leaves[slots[i]] = w
            changed += 1
    return changed

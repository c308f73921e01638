"""TrajectoryStore: a shard's columnar step ring and its trajectory table.

Columns are packed back to back in a ring of ``capacity_steps`` steps (no padding
is stored); the table holds, per slot, start step, length, status (generation and
alive code), insertion stamp and (with a use limit) times sampled, one
:class:`~gear_mpi.kernels.ring.Table` in the narrowest types the sizes allow
(:mod:`gear_mpi.storage.table`), and the raw priorities where the index cannot give them
back. The oldest trajectories are evicted (FIFO) when the ring or the table is full.

Inserts go through :meth:`TrajectoryStore.insert_chunked`: the table planned in chunks by one kernel, the
columns copied alongside (a large batch's in a thread of their own), from the pieces of
:mod:`gear_mpi.storage.store_insert`.

For checkpoints the store exports and restores its own state: :meth:`TrajectoryStore.table_sections`
/ :meth:`TrajectoryStore.restore_table` for the table, :meth:`TrajectoryStore.step_segments` for
the steps in use.

With ``memory="file"`` the columns (:mod:`gear_mpi.storage.file_arenas`, ``path/rank-NNNNN/columns.bin``)
and the table (``slots.bin``) are memory-mapped files, both reserved on disk when the store is
built; with ``memory="mapped"`` the columns are an existing ``columns.bin`` (a checkpoint's)
mapped copy-on-write and the table is in memory. Compressed columns keep their chunks in a log file each
with ``memory="file"`` (:mod:`gear_mpi.storage.chunk_heap`), in a node-shared file each with ``memory="shm"``
(:mod:`gear_mpi.storage.shared_chunks`), in process memory otherwise.
"""
from __future__ import annotations

import contextlib
import mmap
import time
from typing import Callable, Mapping

import numpy as np

from .. import keys as keyspace
from ..errors import CorruptDataError, InvalidKeyError, InvalidTrajectoryError, StaleKeyError
from ..kernels import ring
from . import chunk_heap, file_arenas as file_memory, shared_chunks, store_insert, table as table_layout
from .arenas import (SharedArena, check_header, column_layout, commit_pages, make_arena, memory_kind, small_pages,
                     write_header)
from .compressed import ChunkError, CompressedRing, codec_library, gather_rings
from .huge_pages import Collapser, weak_busy
from ..spec import TrajectorySpec, check_count, whole_number

INSERT_QUIET_S = 0.1  # a large insert counts as running this long after it ends (insert_busy)

_NONE_REMOVED = np.zeros(0, np.int64)

TABLE_BYTES_PER_SLOT = 8 * 8 + 1  # the widest table a slot can take (see table_layout.bytes_per_slot)


class TrajectoryStore:
    """Step ring + trajectory table of one shard.

    Memory: ``capacity_steps * spec.step_bytes`` for the columns (in the chosen
    arena) plus :attr:`table_bytes` of table (``table_layout.bytes_per_slot``: 12 to 41 bytes a
    slot), committed lazily as slots are first used (``memory="file"``: both on disk, reserved at
    once, cached by the page cache). The table is ``store.layout`` (a :class:`~gear_mpi.storage.table.TableLayout`:
    its rows, raw priorities and checkpoint sections); its arrays are ``store.table`` (a :class:`ring.Table`)
    and, by name, ``store.start``, ``store.status``, ... ``store.state``; ``store.alive`` and
    ``store.generation`` name ``status`` too (pass it to the kernels; the alive code is
    ``status >> ring.ALIVE_SHIFT``, the generation ``status & keys.GEN_MASK``), ``store.priority``
    the raw priorities (a row, or a :class:`~gear_mpi.storage.table.DerivedPriority` the shard sets).

    Args:
        spec: the trajectory layout.
        capacity_steps: steps the ring holds (at least ``spec.max_length``).
        max_items: table slots (default ``capacity_steps``), at most ``keys.MAX_SLOTS``.
        memory: ``"private"``, ``"shm"``, ``"file"`` or ``"mapped"`` (``"numpy"``: deprecated name of
            ``"private"``); see :func:`~gear_mpi.storage.arenas.make_arena`.
        rank: the shard's rank, written into its keys.
        tag: the replay's key tag (its low 8 bits are kept).
        arena: an arena to use instead of a new one of ``memory``.
        path: ``memory="file"``/``"mapped"``: the directory holding ``rank-NNNNN/`` (None otherwise).
        max_times_sampled: the shard's use limit (0: uses are not counted, no row is kept for them).
        priority_row: whether to keep raw priorities in a row (False: the shard sets
            ``store.priority`` to read them back from its index).
        lazy_priority: whether the row may stand for one value shared by every slot without being
            written (``priority_constant``, :meth:`~gear_mpi.storage.table.TableLayout.keep_priorities`): for
            selectors whose draws ignore raw priorities (``Uniform``, ``Prioritized(alpha=0)``), so that a
            batch at one priority writes no row.
        stamp_row: whether each slot keeps its insertion stamp (``Fifo``/``Lifo`` shards: they are merged by
            it); False: one per insert, in ``layout.stamp_log`` (:mod:`gear_mpi.storage.stamps`).

    Raises:
        ValueError: a size or rank out of range, an unknown ``memory``, a ``path`` it does not take,
            or (``"mapped"``) a file laid out for another spec or capacity.
        StorageError: ``memory="file"``: ``path`` missing or not writable, or not enough disk.
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, max_items: int | None = None,
                 memory: str = "private", rank: int = 0, tag: int = 0, arena=None, path=None,
                 max_times_sampled: int = 0, priority_row: bool = True, lazy_priority: bool = False,
                 stamp_row: bool = True):
        if isinstance(capacity_steps, bool) or not isinstance(capacity_steps, (int, np.integer)) or capacity_steps < 1:
            raise ValueError(f"capacity_steps must be a positive integer, got {capacity_steps!r}")
        if capacity_steps < spec.max_length:
            raise ValueError(f"capacity_steps={capacity_steps} is smaller than max_length={spec.max_length}")
        max_items = check_count(capacity_steps if max_items is None else max_items, "max_items",
                                most=keyspace.MAX_SLOTS)
        if not (whole_number(rank, 0) and rank < keyspace.MAX_RANKS):
            raise ValueError(f"rank must be in [0, {keyspace.MAX_RANKS}), got {rank}")
        self.spec = spec
        self.capacity = int(capacity_steps)
        self.max_items = max_items
        self.rank = int(rank)
        self.tag = int(tag) & keyspace.TAG_MASK
        self.offsets, nbytes = column_layout(spec, self.capacity)
        memory = memory_kind(memory, stacklevel=3)
        if spec.compressed:
            codec_library()  # before any memory is taken: a clear ImportError when blosc2 is missing
        fields = table_layout.stored_fields(
            table_layout.row_types(self.capacity, max_items, spec.max_length, int(max_times_sampled), stamp_row), max_items,
            priority_row)  # what a file holding the table must carve
        self._table_arena = None
        self.prefetch_windows = True  # file-backed columns: see prefetch()
        if arena is None and memory == "file":  # both files reserved at once: a full disk fails here
            directory = file_memory.rank_directory(path, rank)
            try:
                file_memory.require_space(directory, nbytes + file_memory.carved_bytes(fields))
            except file_memory.StorageError:
                file_memory.remove_if_empty(directory)
                raise
        self.arena = arena if arena is not None else make_arena(memory, nbytes, path, rank)
        try:
            if self.arena.kind == "mapped":  # an existing arena (a checkpoint's): it must be laid out for this
                check_header(self.arena.buffer, spec, self.capacity, self.arena.filename)
            else:
                write_header(self.arena.buffer, spec, self.capacity)
            if memory == "file" and arena is None:
                self._table_arena = file_memory.FileArena.create(directory, file_memory.TABLE_FILE,
                                                                 file_memory.carved_bytes(fields), random=False)
                self._table_arena.unlink()  # only this process maps it: no name needed
        except BaseException:
            self.arena.close()
            raise
        self.columns: dict[str, np.ndarray] = {}
        self._byte_views: dict[str, np.ndarray] | None = None
        self._insert_scratch = store_insert.InsertScratch()  # insert's slots and evictions, reused
        self.ring_touched = 0  # ring steps from 0 ever written by an insert (see reaches_fresh)
        # called as on_write(first, steps) before every insert writes ``steps`` ring steps from ring step ``first``
        # (wrapping): a background checkpoint's record of what changed (gear_mpi.checkpoint.incremental)
        self.on_write: Callable[[int, int], None] | None = None
        self._collapser = None  # page_collapse.Collapser of the last large first fill
        self._inserts_running, self._quiet_from = 0, 0.0  # insert_busy
        # compressed columns: chunks in process memory or files (gear_mpi.storage.compressed), no raw ring here
        self.compressed: dict[str, CompressedRing] = {c.name: CompressedRing(c, self.capacity)
                                                      for c in spec.columns if c.compression is not None}
        if self.compressed and self._table_arena is not None:  # memory="file": their chunks in files of the shard's
            try:
                chunk_heap.file_heaps(self.compressed, spec, directory)
            except BaseException:
                self.arena.close()
                self._table_arena.close()
                raise
        elif self.compressed and self.arena.kind == "shm":  # chunks and table where node peers read them
            try:
                shared_chunks.share_rings(self.compressed, spec, self.arena.name)
            except BaseException:
                self.arena.close()
                raise
        #: bytes per step the gather kernels copy from the arena: 0 for compressed columns (filled afterwards
        #: by :meth:`gather_compressed`)
        self.gather_step_bytes = np.array([0 if c.compression is not None else c.step_bytes for c in spec.columns],
                                          np.int64)
        self.gather_step_bytes.flags.writeable = False
        self._placeholder = np.zeros(64, np.uint8)  # what a compressed column's byte view is
        for c in spec.columns:
            if c.compression is not None:
                continue
            raw = self.arena.buffer[self.offsets[c.name]:self.offsets[c.name] + c.step_bytes * self.capacity]
            self.columns[c.name] = raw.view(c.dtype).reshape((self.capacity,) + c.shape)
        # a new file's reserved, zero blocks, or zeroed rows staggered within their pages: committed at first use
        carved = file_memory.carve(self._table_arena.buffer, fields) if self._table_arena is not None else None
        self.layout = table_layout.TableLayout(self.capacity, max_items, spec.max_length, int(max_times_sampled),
                                               priority_row, lazy_priority, carved, stamp_row)
        self.table_bytes = self.layout.nbytes
        self.counts_uses = bool(max_times_sampled)
        self._take_table()

    # ---- raw priorities (the layout's) ------------------------------------------------------
    @property
    def priority(self):
        """The raw priorities: a float64 row, a :class:`~gear_mpi.storage.table.DerivedPriority` (the shard sets
        it: its index gives them back) or None; ``layout.priority``. Settable. O(1)."""
        return self.layout.priority

    @priority.setter
    def priority(self, row) -> None:
        self.layout.priority = row

    @property
    def priority_constant(self) -> float | None:
        """None: the row holds every slot's raw priority. A float: every slot below the high-water mark has this
        raw priority and the row is not kept up to date (:meth:`TableLayout.keep_priorities
        <gear_mpi.storage.table.TableLayout.keep_priorities>`); ``layout.priority_constant``. Settable. O(1)."""
        return self.layout.priority_constant

    @priority_constant.setter
    def priority_constant(self, value: float | None) -> None:
        self.layout.priority_constant = value

    # ---- sizes ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Live trajectories (0 once closed). O(1)."""
        return int(self.state[ring.LIVE_COUNT]) if self.arena is not None else 0

    @property
    def live_steps(self) -> int:
        """Steps of the live trajectories (0 once closed). O(1)."""
        return int(self.state[ring.LIVE_STEPS]) if self.arena is not None else 0

    @property
    def steps_used(self) -> int:
        """Ring steps in use: live trajectories and removed ones not yet released. O(1)."""
        return int(self.state[ring.STEPS_USED])

    def byte_views(self) -> dict[str, np.ndarray]:
        """Each column as a flat uint8 array over the whole ring (for the gather kernels).

        Returns:
            Column name -> uint8 view of ``capacity * step_bytes`` bytes of the arena (a compressed column:
            64 zero bytes, which the kernels read nothing from: :attr:`gather_step_bytes`); built once, then
            the same dict.
        """
        if self._byte_views is None:
            self._byte_views = {
                c.name: self._placeholder if c.compression is not None else
                self.arena.buffer[self.offsets[c.name]:self.offsets[c.name] + c.step_bytes * self.capacity]
                for c in self.spec.columns}
        return self._byte_views

    # ---- insertion ------------------------------------------------------------------
    def check_batch(self, lengths: np.ndarray, steps: int | None = None) -> None:
        """Check that a batch of trajectories can be stored at once (before anything changes).

        Args:
            lengths: the steps of each trajectory.
            steps: their sum, where the caller has it (None: summed here, O(n)).

        Raises:
            InvalidTrajectoryError: more steps than ``capacity_steps``, or more trajectories than
                ``max_items``.
        """
        total = int(lengths.sum()) if steps is None else int(steps)
        if total > self.capacity:
            raise InvalidTrajectoryError(
                f"insert_many: {len(lengths)} trajectories hold {total} steps, more than capacity_steps={self.capacity}")
        if len(lengths) > self.max_items:
            raise InvalidTrajectoryError(
                f"insert_many: {len(lengths)} trajectories, more than max_items={self.max_items}")

    def insert(self, columns: dict[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store already-validated trajectories whose steps are concatenated in ``columns``.

        Evicts the oldest trajectories (FIFO) to make room. The caller has passed the
        batch through :meth:`check_batch`.

        Args:
            columns: column name -> all the batch's steps, back to back, in the column's dtype.
            lengths: int64 steps of each trajectory.
            priorities: the raw priority of each (float64).

        Returns:
            (slots of the new trajectories, slots of the live trajectories evicted): new arrays.

        Cost: as :meth:`insert_chunked` (O(n) table work in a kernel plus one copy of the steps, at most
        two slices per column, for the ring's wrap-around), plus the two arrays returned.
        """
        slots = np.empty(len(lengths), np.int64)
        gone: list[np.ndarray] = []
        self.insert_chunked(columns, lengths, priorities, slots, lambda e: gone.append(e.copy()))
        return slots, (np.concatenate(gone) if gone else np.zeros(0, np.int64))

    def insert_chunked(self, columns, lengths: np.ndarray, priorities: np.ndarray, slots_out: np.ndarray,
                       on_evicted: Callable[[np.ndarray], None] | None = None, steps: int | None = None,
                       after_chunk: Callable[[int, int], None] | None = None) -> int:
        """Store already-validated trajectories laid end to end, evicting the oldest (FIFO) to make room, the
        table planned chunk by chunk (the same table as one pass: the chunks are planned in order, with one
        stamp). The body of every shard insert; the caller has passed the batch through :meth:`check_batch`.

        Args:
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
        Cost: one table pass in a kernel (O(n + evictions)) in chunks of ``store_insert.CHUNK_ITEMS``, one
        copy per column (at most two slices, for the ring's wrap-around, the dtype cast inside the copy); no
        allocation once the scratch is large enough (it is bounded). A batch of ``store_insert.OVERLAP_BYTES``
        or more copies its columns in a thread started for it (numpy's copy and the table kernel both
        release the GIL) while this thread plans the table: the two overlap on two cores (1e7 one-step items, warm:
        0.33-0.39 s -> 0.23-0.26 s here); that thread then writes the raw priorities and runs ``after_chunk``
        of the chunks planned, while this one plans the next. The copies go in pieces (``PIECE_BYTES``):
        this thread, done planning, copies those still left (a cold ring's fresh pages: 1e7 one-step items,
        first insert 1.97-2.35 s -> 1.59-1.71 s here). All of it ends before this returns, or raises.
        """
        total = int(lengths.sum()) if steps is None else int(steps)
        with self.inserting(total * self.spec.step_bytes):
            return self._insert_chunked(columns, lengths, priorities, slots_out, on_evicted, total, after_chunk)

    @contextlib.contextmanager
    def inserting(self, nbytes: int):
        """The span of an insert of ``nbytes`` (the shard's whole insert wraps the store's), for
        :meth:`insert_busy`. Nests. O(1)."""
        self._inserts_running += 1
        try:
            yield
        finally:
            self._inserts_running -= 1
            if nbytes >= store_insert.OVERLAP_BYTES:
                self._quiet_from = time.monotonic() + INSERT_QUIET_S

    def insert_busy(self) -> bool:
        """Whether an insert runs, or a large one (``store_insert.OVERLAP_BYTES`` or more) ended less than
        :data:`INSERT_QUIET_S` ago: a bulk load is under way, which a background collapse should not slow. O(1)."""
        return self._inserts_running > 0 or time.monotonic() < self._quiet_from

    def _insert_chunked(self, columns, lengths, priorities, slots_out, on_evicted, total, after_chunk) -> int:
        shared = priorities.strides == (0,)
        now = time.time_ns()
        # the batch's steps go to the ring's tail, where the table pass will put them: evictions take steps
        # from the head only, so the tail is known now and the copies can run while the table is planned
        first = int(self.state[ring.STEP_HEAD] + self.state[ring.STEPS_USED]) % self.capacity
        # raw priorities, where the table keeps them and its row does not stand for them already
        row = self.layout.priority
        keeps_priorities = isinstance(row, np.ndarray) and self.layout.keep_priorities(priorities)

        def finish_chunk(lo: int, hi: int) -> None:  # after the chunk's plan: touches its slots' rows only
            if keeps_priorities:
                store_insert.set_priorities(row, slots_out[lo:hi],
                                            priorities[:1] if shared else priorities[lo:hi])
            if after_chunk is not None:
                after_chunk(lo, hi)

        for name, chunks in self.compressed.items():  # compressed here, on the inserting side, chunk by chunk
            chunks.write(first, columns[name][:total])
        if self.on_write is not None:
            self.on_write(first, total)
        fresh = total * self.spec.step_bytes >= store_insert.OVERLAP_BYTES and self.reaches_fresh(first + total)
        first_seq = int(self.state[ring.NEXT_SEQ])
        with small_pages(self.fresh_arrays() if fresh else ()) as pages:
            evicted_all = self._insert_chunks(columns, lengths, priorities, slots_out, on_evicted, first, total,
                                              now, finish_chunk, fresh)
        self.layout.record_stamp(first_seq, now)
        self.ring_touched = self.capacity if first + total >= self.capacity else max(self.ring_touched, first + total)
        if pages.maps:  # 4 KiB pages were committed: merged into huge pages now, in the background (opt-in)
            self.collapse_written()
        return evicted_all

    def reaches_fresh(self, end: int) -> bool:
        """Whether an insert whose steps end at ring step ``end`` (unwrapped) may write memory never written
        before: ring steps past :attr:`ring_touched` or table slots never used. O(1)."""
        return end > self.ring_touched or int(self.state[ring.NEXT_FRESH]) < self.max_items

    def fresh_arrays(self) -> list[np.ndarray]:
        """The arrays a large first fill commits: the column arena and the table's rows (the raw priorities'
        too, where kept): what :class:`~gear_mpi.storage.arenas.small_pages` advises. O(1)."""
        return ([] if self.arena is None else [self.arena.buffer]) + self.layout.written_rows()

    def written_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of what inserts have written so far: each column's ring steps from 0 to
        ``ring_touched`` and each table row's slots below the first never used (``ring.NEXT_FRESH``). O(columns)."""
        steps, slots = min(self.ring_touched, self.capacity), int(self.state[ring.NEXT_FRESH])
        out = [(c.ctypes.data, steps * c.strides[0]) for c in self.columns.values()]
        out += [(a.ctypes.data, slots * a.strides[0]) for a in self.layout.written_rows()]
        return out

    def _insert_chunks(self, columns, lengths, priorities, slots_out, on_evicted, first, total, now, finish_chunk,
                       fresh: bool = False) -> int:
        """:meth:`insert_chunked`'s table pass and copies (its arguments, the tail ``first`` and the stamp
        ``now`` computed; ``fresh``: it reaches memory never written, committed ahead of the writes: the
        copies' pieces in the copy thread, each chunk's table rows and slots in this one). Returns the live
        trajectories evicted."""
        n = len(lengths)
        copying = self._start_copies(columns, first, total, slots_out, finish_chunk,
                                     self.ring_touched if fresh else None)
        rows = [a for a in self.table if a.strides[0] and len(a) == self.max_items and a is not self.order] \
            if fresh else []
        evicted_all = 0
        try:
            lo = 0
            while lo < n:
                hi, part_steps = store_insert.chunk_end(lengths, lo, store_insert.CHUNK_ITEMS,
                                                        store_insert.SCRATCH_ENTRIES)
                part = lengths[lo:hi]
                need = store_insert.eviction_bound(self.state, self.max_items, self.capacity, hi - lo,
                                                   int(part_steps))
                evicted = self._insert_scratch.take(need)
                if rows:
                    self._commit_chunk_rows(rows, slots_out[lo:hi])
                k = ring.plan_insert(self._arrays, self.capacity, part, now, slots_out[lo:hi], evicted[:need])
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
            self._copy_columns(columns, first, total)
        return evicted_all

    def _commit_chunk_rows(self, rows: list[np.ndarray], slots: np.ndarray) -> None:
        """Commit the pages the table pass of a chunk of ``len(slots)`` trajectories is about to write for the
        first time (:func:`~gear_mpi.storage.arenas.commit_pages`: cheaper than faulting them in one by one): its
        never-used slots' entries of ``rows`` (slots are taken from the free stack first, then from the
        high-water mark up), its places in the order ring, and ``slots`` (the keys out). O(pages)."""
        k = len(slots)
        hwm = int(self.state[ring.NEXT_FRESH])
        fresh = min(k, self.max_items - hwm)
        if fresh <= 0:
            return
        for row in rows:
            commit_pages(row[hwm:hwm + fresh])
        tail = int(self.state[ring.ORDER_HEAD] + self.state[ring.ORDER_COUNT]) % self.max_items
        commit_pages(self.order[tail:tail + k])
        commit_pages(slots)

    def _start_copies(self, columns, first: int, total: int, slots_out: np.ndarray | None = None,
                      finish: Callable[[int, int], None] | None = None,
                      fresh_from: int | None = None) -> store_insert.ColumnCopies | None:
        """The column copies of a large batch started in a thread (then ``slots_out``'s pages committed and
        the chunks handed to it finished by ``finish``; pieces reaching ring step ``fresh_from`` committed
        before they are copied), or None (a small batch: the caller does all)."""
        if total * self.spec.step_bytes < store_insert.OVERLAP_BYTES:
            return None
        return store_insert.ColumnCopies(self._copy_pieces(columns, first, total, fresh_from), slots_out, finish)

    def _copy_columns(self, columns, first: int, total: int) -> None:
        """Copy ``total`` steps of ``columns`` into the ring from step ``first`` (wrapping around),
        piece by piece (:meth:`_copy_pieces`) in this thread."""
        for dst, src, _ in self._copy_pieces(columns, first, total):
            dst[...] = src

    def _copy_pieces(self, columns, first: int, total: int,
                     fresh_from: int | None = None) -> list[tuple[np.ndarray, np.ndarray, bool]]:
        """The copies of ``total`` steps of ``columns`` into the ring from step ``first`` (wrapping around),
        as (destination, source, commit first) triples of about ``store_insert.PIECE_BYTES`` each: a piece
        reaching ring steps from ``fresh_from`` on (never written; None: none is) has its pages committed
        before it is copied (:func:`~gear_mpi.storage.arenas.commit_pages`)."""
        head = min(total, self.capacity - first)
        pieces = []
        for name, data in columns.items():
            if name in self.compressed:
                continue
            dst = self.columns[name]
            step = max(1, store_insert.PIECE_BYTES // max(1, dst[:1].nbytes))
            for a, b, at in ((0, head, first), (head, total, first - self.capacity)):
                for lo in range(a, b, step):
                    hi = min(b, lo + step)
                    pieces.append((dst[at + lo:at + hi], data[lo:hi],
                                   fresh_from is not None and at + hi > fresh_from))
        return pieces

    def prefetch(self, start: np.ndarray, steps: np.ndarray) -> None:
        """Ask the kernel to read the windows about to be copied (``MADV_WILLNEED`` on each window of
        each column), for file-backed columns only: with ``MADV_RANDOM`` a page fault reads one page,
        so a cold window would cost one synchronous disk read per page; this starts them all at once.

        Args:
            start: the ring step where each window starts (int64).
            steps: its real steps (int64).
        Cost: nothing for memory arenas (or with ``store.prefetch_windows = False``); else one madvise
        per window and column (a few us each even when the pages are cached: about 1 ms for 64 image
        windows of 4 columns, 20% of such a warm sample), and the reads it starts.
        """
        arena = self.arena
        if not self.prefetch_windows or getattr(arena, "kind", None) not in ("file", "mapped") or len(start) == 0:
            return
        page = mmap.PAGESIZE
        cap = self.capacity
        start = np.asarray(start, np.int64)
        first = np.minimum(np.asarray(steps, np.int64), cap - start)  # steps before the ring wraps
        for c in self.spec.columns:
            if c.compression is not None:
                continue
            base, sb = self.offsets[c.name], c.step_bytes
            lo = base + start * sb
            hi = lo + first * sb
            wrapped = steps > first
            lo = np.concatenate([lo, np.full(int(wrapped.sum()), base, np.int64)])
            hi = np.concatenate([hi, base + (steps - first)[wrapped] * sb])
            lo -= lo % page
            for a, b in zip(lo.tolist(), hi.tolist()):
                if b > a:
                    arena.advise(mmap.MADV_WILLNEED, a, b - a)

    def will_read(self, view: np.ndarray) -> None:
        """Ask the kernel to start reading ``view`` (bytes of this store's columns) ahead of a sequential
        pass, as a save makes: ``MADV_RANDOM`` turns read-ahead off. File-backed columns only. O(1) call.

        Args:
            view: a view into ``self.arena.buffer``.
        """
        arena = self.arena
        if getattr(arena, "kind", None) not in ("file", "mapped") or view.nbytes == 0:
            return
        lo = view.ctypes.data - arena.buffer.ctypes.data
        lo -= lo % mmap.PAGESIZE
        arena.advise(mmap.MADV_WILLNEED, lo, view.ctypes.data - arena.buffer.ctypes.data + view.nbytes - lo)

    def count_samples(self, slots: np.ndarray, max_times: int) -> np.ndarray:
        """Add one use to each of ``slots``; remove those that reached ``max_times`` uses.

        Args:
            slots: the sampled slots (int64; repeats count once each).
            max_times: uses after which an item is removed (0: never; uses are only counted by a store
                built with ``max_times_sampled``).

        Returns:
            The slots removed now (their index weights must be zeroed). Cost: O(B), one kernel.
        """
        if not self.counts_uses or max_times <= 0:
            return _NONE_REMOVED
        return ring.count_samples(self._arrays, self.capacity, slots, max_times)

    def clear(self) -> np.ndarray:
        """Remove every trajectory (counted as removed), generations moved on so that earlier keys are stale,
        and the ring's head put back at step 0 (the next insert starts there, as in a new store). The
        columns' bytes stay as they were until overwritten; the pages stay committed.

        Returns:
            The slots that were live (int64), whose index weights the caller zeroes. Cost: O(trajectories
            held), one kernel.
        """
        for chunks in self.compressed.values():  # their memory is given back at once
            chunks.reset()
        return ring.clear_table(self._arrays, self.capacity)

    # ---- keys -----------------------------------------------------------------------
    def keys_of(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The keys of ``slots``.

        Args:
            slots: table slots.
            out: an int64 array of ``len(slots)`` to fill, or None for a new one.

        Returns:
            The keys (``out`` when given). O(B), one kernel.
        """
        slots = np.ascontiguousarray(slots, np.int64)
        out = np.empty(len(slots), np.int64) if out is None else out
        keyspace.encode_slots(self.tag, self.rank, slots, self.status, out)
        return out

    def resolve(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map keys of this shard to slots.

        Args:
            keys: int64 keys issued by this shard.

        Returns:
            (slots, live mask): a stale key (its trajectory evicted or removed) is not live.

        Raises:
            InvalidKeyError: a key of another replay or shard, or naming a slot out of range.

        Cost: O(n), one kernel.
        """
        keys = np.ascontiguousarray(keys, np.int64)
        slot = np.empty(len(keys), np.int64)
        live = np.empty(len(keys), np.bool_)
        if ring.resolve_keys(keys, self.tag, self.rank, self.max_items, self.status, slot, live) < 0:
            return slot, live
        tag, rank, gen, slot = keyspace.decode(keys)  # a foreign key: find it again, for the message
        bad = (keys < 0) | (tag != self.tag) | (rank != self.rank) | (slot >= self.max_items)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            k = int(keys[i])
            if k < 0 or int(tag[i]) != self.tag:
                raise InvalidKeyError(f"key {k} was not issued by this replay")
            if int(rank[i]) != self.rank:
                raise InvalidKeyError(f"key {k} belongs to shard {int(rank[i])}, not this shard ({self.rank})")
            raise InvalidKeyError(f"key {k} names slot {int(slot[i])}, but this shard has {self.max_items} slots")
        live = self.status[slot] == ((ring.LIVE << ring.ALIVE_SHIFT) | gen)
        return slot, live

    def read(self, key: int) -> dict[str, np.ndarray]:
        """A copy of the whole trajectory behind ``key``.

        Args:
            key: a key of this shard.

        Returns:
            Column name -> array of the trajectory's steps. O(L).

        Raises:
            StaleKeyError: the trajectory has been evicted or removed.
            InvalidKeyError: not a key of this shard.
        """
        slots, live = self.resolve(np.array([key], np.int64))
        if not live[0]:
            raise StaleKeyError(f"key {key}: its trajectory has been evicted or removed")
        s = int(slots[0])
        start, length = int(self.start[s]), int(self.length[s])
        idx = (start + np.arange(length)) % self.capacity
        out = {}
        for c in self.spec.columns:
            if c.compression is None:
                out[c.name] = self.columns[c.name][idx]
                continue
            try:
                out[c.name] = self.compressed[c.name].read_steps(idx)
            except ChunkError as e:
                raise self.corrupt(c.name, e, f"trajectory key {key}") from None
        return out

    # ---- order ------------------------------------------------------------------------
    def live_slots(self, newest_first: bool = False, limit: int | None = None) -> np.ndarray:
        """The live slots in insertion order.

        Args:
            newest_first: newest first instead of oldest first.
            limit: at most this many (None: all).

        Returns:
            An int64 array of slots. Cost: O(slots scanned), one kernel.
        """
        t = self.table
        return ring.live_in_order(t.state, t.status, t.order, newest_first, len(self) if limit is None else int(limit))

    # ---- checkpoint state -------------------------------------------------------------
    def table_sections(self) -> list[tuple[str, np.ndarray]]:
        """The table in use, as (name, array view) pairs in the checkpoint's order.

        Returns:
            The rows ``ring.TABLE_ROWS``, each ``[:hwm]`` (``hwm = state[NEXT_FRESH]``, the slots
            ever used); then ``"order"``, the live part of the order ring oldest first, as one
            or two views of the same name; then ``"free"``, the free-slot stack, bottom first. Each
            in its row's type (:mod:`~gear_mpi.storage.table`). Stored rows are views, no copy (write
            them out before the store changes); derived ones (``seq``, ``generation``, ``alive``,
            ``free``, and ``priority``, ``length``, ``times_sampled`` where not stored) are computed,
            O(hwm). ``state`` itself is not among them (save ``store.state[:ring.STATE_SIZE]``).
        """
        return self.layout.sections()

    def restore_table(self, state: np.ndarray, sections: Mapping[str, np.ndarray]) -> None:
        """Load a table saved by :meth:`table_sections` (the inverse), with its counters ``state``.

        Everything is checked before anything changes. Rows past the saved high-water
        mark are reset to zero (only those this store had used: no page is committed).
        Load the steps afterwards, through :meth:`step_segments`.

        Args:
            state: the ``ring.STATE_SIZE`` counters (``store.state`` when saved).
            sections: each row of ``ring.TABLE_ROWS`` with ``state[NEXT_FRESH]`` entries,
                ``"order"`` (the live order ring concatenated, oldest first, ``state[ORDER_COUNT]``
                entries) and ``"free"`` (``state[FREE_TOP]`` entries): integer sections of any integer
                type (format 2 and 3 saved int64) are cast to the rows' types, ``priority`` is float64
                (ignored where the index gives priorities back), ``times_sampled`` is ignored by a
                store that does not count uses.

        Raises:
            ValueError: a section missing or of the wrong length or dtype (named in the message),
                values out of the rows' ranges, or counters that do not fit this store's capacity
                and max_items.
        """
        self.layout.restore(state, sections)

    def step_segments(self, name: str) -> list[np.ndarray]:
        """The ring steps in use of column ``name``, as flat byte views, oldest first.

        Read them to save the steps; after :meth:`restore_table`, read a saved copy into
        them to load the steps back where they were.

        Args:
            name: a column of the spec.

        Returns:
            At most two uint8 views (the ring wraps), ``steps_used * step_bytes`` bytes in all.

        Raises:
            KeyError: no column ``name``.
            ValueError: a compressed column (its chunks are saved as they are: :attr:`compressed`).
        """
        if name in self.compressed:
            raise ValueError(f"column {name!r} is compressed: it has no raw ring steps (save store.compressed[{name!r}])")
        view = self.byte_views()[name]
        sb = self.spec[name].step_bytes
        head, used = int(self.state[ring.STEP_HEAD]), int(self.state[ring.STEPS_USED])
        return [view[a * sb:b * sb] for a, b in ring.ring_segments(head, used, self.capacity)]

    def collapse_written(self) -> None:
        """Merge the pages inserts have written into huge pages, in the background (:mod:`gear_mpi.storage.huge_pages`;
        after a large first fill on 4 KiB pages). Local; returns at once."""
        if self._collapser is not None:
            self._collapser.stop()
        self._collapser = Collapser(self.written_ranges(), busy=weak_busy(self))

    def _take_table(self) -> None:
        """The layout's rows as ``table``, the kernels' tuple and attributes (``store.start``, ...; see ring.Table)."""
        self.table, self._arrays = self.layout.rows, self.layout.arrays
        self.__dict__.update(self.table._asdict())
        self.alive = self.generation = self.status

    def close(self) -> None:
        """Drop the columns and close the arena (a shared segment this store created is unlinked). Idempotent."""
        if getattr(self, "_collapser", None) is not None:  # before the mappings go
            self._collapser.stop()
            self._collapser = None
        self.columns = {}
        for chunks in self.compressed.values():
            chunks.close()
        self.compressed = {}
        self._byte_views = None
        self._insert_scratch.drop()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self._table_arena is not None:  # the table's arrays keep the mapping (and the file's disk) until they go
            self.layout.release()
            self._take_table()
            self._table_arena.close()
            self._table_arena = None

    # ---- compressed columns -----------------------------------------------------------
    @property
    def compressed_bytes(self) -> int:
        """Bytes the compressed columns hold: sealed chunks plus each column's raw open chunk. O(columns)."""
        return sum(c.stored_bytes + c.chunk_bytes for c in self.compressed.values())

    def steps_at(self, name: str, ring_steps: np.ndarray) -> np.ndarray:
        """A copy of column ``name``'s steps at ``ring_steps`` (a compressed column's decompressed, chunk by
        chunk). O(steps) (plus one decompression per chunk touched).

        Raises:
            KeyError: no column ``name``.
            CorruptDataError: a compressed chunk touched is corrupted.
        """
        if name not in self.compressed:
            return self.columns[name][ring_steps]
        try:
            return self.compressed[name].read_steps(ring_steps)
        except ChunkError as e:
            raise self.corrupt(name, e, "a trajectory read") from None

    def gather_compressed(self, starts: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray,
                          out_rows: np.ndarray, outs: Mapping[str, np.ndarray], window: int,
                          keys: np.ndarray | None = None) -> None:
        """Windows of the compressed columns into batch rows (what the gather kernels leave out: padding
        included). Cost: per column, one decompression per chunk the windows cover (see
        :meth:`CompressedRing.gather <gear_mpi.storage.compressed.CompressedRing.gather>`). Local.

        Args:
            starts, n_valid, pad_front, out_rows: each window's ring start, real steps, leading padding and
                batch row (int64).
            outs: column name -> that column's batch bytes (flat uint8): the compressed columns named here
                are filled (other names are ignored).
            window: steps per window.
            keys: each window's key (for the error message), or None.
        Raises:
            CorruptDataError: a chunk that fails its checksum or does not decompress, naming the column,
                the chunk's ring steps and the trajectories it holds.
        """
        gather_rings(self.compressed, self.capacity, starts, n_valid, pad_front, out_rows, outs, window, keys,
                     self.corrupt)

    def corrupt(self, name: str, error: ChunkError, what: str) -> CorruptDataError:
        """The error for a corrupted chunk of column ``name``: its ring steps and the live trajectories on them.
        O(live trajectories)."""
        return CorruptDataError(f"column {name!r}: {what} reads {self.describe_chunk(name, error.chunk)}, and "
                                f"{error.why}: the stored data is corrupted (nothing was returned)")

    def describe_chunk(self, name: str, j: int) -> str:
        """``"compressed chunk j (ring steps a..b), holding trajectory slot(s) [...] (keys [...])"``. O(live)."""
        chunks = self.compressed[name]
        lo, hi = j * chunks.k, j * chunks.k + chunks.chunk_steps(j)
        slots = self.live_slots()
        start, length = self.start[slots].astype(np.int64), self.length[slots].astype(np.int64)
        off = (lo - start) % self.capacity  # the chunk's first step, relative to each trajectory's start
        hit = (off < length) | ((start - lo) % self.capacity < hi - lo)
        held = slots[hit][:8]
        keys = self.keys_of(held).tolist() if len(held) else []
        return (f"compressed chunk {j} (ring steps {lo}..{hi - 1}), holding trajectory slot(s) {held.tolist()}"
                f"{'...' if hit.sum() > 8 else ''} (keys {keys})")

    @property
    def shm_name(self) -> str | None:
        """The name node peers map the columns by: a shared-memory segment's name, or (``memory="file"``)
        the columns file's absolute path; None for private and copy-on-write memory."""
        return self.arena.name if isinstance(self.arena, (SharedArena, file_memory.FileArena)) else None


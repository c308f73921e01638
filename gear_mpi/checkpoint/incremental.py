"""One rank's part of an incremental checkpoint: what changed, a snapshot that copies on write, its files.

A :class:`Changes` record hangs on the shard's store (``store.on_write``) and notes which ring
segments (:mod:`~gear_mpi.checkpoint.segment_file`) each insert writes. :func:`snapshot`, called by
the training thread between two collectives, decides per segment holding steps in use:

- not written since the previous checkpoint of this rank (its *base*): a hard link to the base's file(s)
  (their manifest entries reused, nothing read or written);
- written since only past the end of what the base stored of it (the segment at the write position, partly
  filled at the base and filled further since): the base's parts linked, and one new *part* pending for
  the steps from there to the segment's last step worth storing (:mod:`~gear_mpi.checkpoint.segment_file`,
  parts) -- so a second checkpoint writes about what was inserted, not two whole segments more;
- written since (or no base): *pending*. Nothing is copied now: :func:`write`, in a thread of its own,
  writes each pending segment's file straight from the shard's memory. An insert that is about to
  overwrite a segment still pending (or being written) first copies it (:meth:`Snapshot.protect`, called
  from ``store.on_write`` before the insert writes a byte) -- copy on write: the thread writes that copy
  instead, and a file it was writing from the shard's memory at that moment is discarded and written
  again from the copy. Copies are bounded by ``copy_limit`` bytes; past it the insert writes the
  segment's file itself before it goes on.

The table sections, the priority index and the rank's state are copied by :func:`snapshot` (about 70
bytes per slot in use), and so are the chunks of compressed columns, as stored (they go to
``compressed.bin`` whole, :mod:`~gear_mpi.checkpoint.compressed_file`: not incremental). :func:`write` then touches only the snapshot and the pending segments' memory
(never MPI): it writes the segments (within its :class:`~gear_mpi.checkpoint.pacing.Pacer`'s budget),
links the others, writes the table blocks that changed and links the others
(:mod:`~gear_mpi.checkpoint.table_blocks`), writes ``shard.json``, fsyncs, and marks the rank's directory done
(``done.json``, :mod:`~gear_mpi.checkpoint.series`) -- or failed (``failed.json``). Every segment file
holds the bytes the segment had when the snapshot was taken.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..errors import CheckpointError
from ..kernels import ring
from . import compressed_file, files, segment_file, series, shard_files, table_blocks
from .files import SHARD_JSON, rank_dir
from .pacing import CHUNK, Pacer

MAX_PARTS = 8  # parts a segment is stored in at most: past it, the segment is written again whole


class Changes:
    """The ring segments written since the last :meth:`take`, each with the first ring step written in it
    (called by every insert: ``store.on_write``).

    Args:
        k: ring steps per segment; capacity: the ring's steps.
    Cost: O(1) per insert that stays in the segment of the previous one, else O(segments it spans).
    """

    def __init__(self, k: int, capacity: int):
        self.k, self.capacity = int(k), int(capacity)
        self.segments: dict[int, int] = {}  # segment -> the lowest ring step written in it
        self._last = -1  # the segment the last insert ended in (already noted)

    def __call__(self, first: int, steps: int) -> None:
        if steps <= 0:
            return
        first, steps, k = int(first), int(steps), self.k
        last = self._last
        if steps < k and first // k == last and (first + steps - 1) // k == last and first + steps <= self.capacity:
            if first < self.segments[last]:  # a ring of one segment, wrapped
                self.segments[last] = first
            return
        seg = segment_file.touched(first, steps, self.capacity, k)
        whole = steps >= self.capacity
        for s in seg:
            lo = first if (s == first // k and not whole) else s * k
            if lo < self.segments.get(s, lo + 1):
                self.segments[s] = lo
        if not whole and first + steps > self.capacity and first // k in seg[-1:]:  # wrapped into its own segment
            self.segments[first // k] = (first // k) * k
        self._last = seg[-1]

    def take(self) -> dict[int, int]:
        """The segments written since the last call (each with its lowest ring step written), and start over. O(1)."""
        out, self.segments, self._last = self.segments, {}, -1
        return out


@dataclass
class Base:
    """A rank's part of its previous checkpoint: where its files are and their manifest entries."""
    directory: str
    entries: dict[int, list[tuple[int, int, dict]]]  # segment -> its parts: (lo, hi, {"bytes", "sha256"})
    tables: dict[str, dict] = field(default_factory=dict)      # table block file -> {"bytes", "sha256"}
    flats: dict[str, np.ndarray] = field(default_factory=dict)  # section stem -> the copy its blocks hold


@dataclass
class Snapshot:
    """What :func:`write` needs, taken by :func:`snapshot`: the pending segments are read from the shard's
    memory until an insert copies them (:meth:`protect`); :meth:`release` ends those reads."""
    directory: str                   # this rank's directory of the checkpoint
    rank: int
    links: list[tuple[str, str, dict]] = field(default_factory=list)     # (name, base file, entry)
    parts: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # segment -> its parts' ring steps
    link_copies: list[tuple[str, str]] = field(default_factory=list)     # (base file, name): no hard links here
    entries: dict[str, dict] = field(default_factory=dict)               # files already written
    sections: list[np.ndarray] = field(default_factory=list)   # the table's copy (table_blocks.Copies)
    stems: list[str] = field(default_factory=list)            # per group of sections: its block files' stem
    flats: list[np.ndarray] = field(default_factory=list)     # per group: its bytes in the copy
    table_entries: dict[str, dict] = field(default_factory=dict)       # table blocks linked at the snapshot
    table_pending: list = field(default_factory=list)                   # (name, bytes) of those to write
    table_written: int = 0   # bytes of table blocks written (the others linked from the base)
    table_linked: int = 0
    compressed: list[np.ndarray] = field(default_factory=list)  # compressed.bin's arrays (copied), if any
    meta: dict[str, Any] = field(default_factory=dict)
    items: int = 0
    steps_used: int = 0
    changed: int = 0         # bytes of the segments written since the base (all written by this checkpoint)
    linked: int = 0          # bytes linked from the base
    copied: int = 0          # bytes inserts copied before overwriting a pending segment (the loop's cost)
    written_now: int = 0     # bytes inserts wrote themselves (past copy_limit; the loop's cost)
    copy_limit: int = 0
    k: int = 1               # ring steps per segment
    capacity: int = 0
    order: list[int] = field(default_factory=list)                  # pending segments, in the order to write
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)  # segment -> its new part's steps [a, b)
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)   # segment -> its new part's steps (kept)
    saved: dict[int, np.ndarray] = field(default_factory=dict)      # segment -> its bytes, copied by an insert
    busy: int = -1           # the segment the thread is writing from the shard's memory (-1: none)
    closed: bool = False     # released: the shard's memory may be gone
    rush: bool = False       # an insert waits for the segment being written: no pacing
    failure: str = ""        # why an insert could not write a segment (the checkpoint fails)
    views: dict | None = None
    spec: Any = None
    lock: threading.Condition = field(default_factory=threading.Condition)

    @property
    def to_write(self) -> int:
        """Bytes :func:`write` will write (the changed segments, the table, compressed chunks). O(sections)."""
        return self.changed + sum(int(a.nbytes) for a in self.sections) + sum(int(a.nbytes) for a in self.compressed)

    def protect(self, first: int, steps: int) -> None:
        """Called (``store.on_write``) before an insert writes ``steps`` ring steps from ``first``: copy every
        pending segment among them (or, past ``copy_limit``, write its file now), so that the thread never
        needs bytes the insert changes. Training thread; O(1) when none is pending, else a copy per segment.

        A segment file it cannot write (past ``copy_limit``) fails the checkpoint, not the insert: the thread
        raises :class:`~gear_mpi.errors.CheckpointError` with the reason.
        """
        if steps <= 0 or not (self.pending or self.busy >= 0):
            return
        with self.lock:
            touched = [s for s in segment_file.touched(int(first), int(steps), self.capacity, self.k)
                       if not self._past(s, int(first), int(steps))]
            for s in touched:  # first those not begun: copied, or written here
                if s not in self.pending:
                    continue
                a, b = self.pending.pop(s)
                n = segment_file.nbytes(self.spec, a, b)
                if self.copied + n <= self.copy_limit:
                    self.saved[s] = segment_file.copy(self.views, self.spec, a, b)
                    self.copied += n
                else:
                    name = segment_file.part_name(s, a, self.k)
                    try:
                        self.entries[name] = files.write_file(os.path.join(self.directory, name),
                                                              segment_file.pieces(self.views, self.spec, a, b))
                    except OSError as e:  # this checkpoint fails (the thread says so); the insert goes on
                        self.failure = f"an insert could not write {name} past copy_limit: {e}"
                        self.closed = True
                        self.pending.clear()
                        self.order.clear()
                        self.saved.clear()
                        break
                    self.written_now += n
            s = self.busy
            if s >= 0 and s not in self.saved and s in touched:  # the one the thread is reading now
                a, b = self.ranges[s]
                n = segment_file.nbytes(self.spec, a, b)
                if not self.closed and self.copied + n <= self.copy_limit:  # the thread writes this copy instead
                    self.saved[s] = segment_file.copy(self.views, self.spec, a, b)
                    self.copied += n
                    return
                self.rush = True  # past the limit: let it finish that segment, unpaced
                while self.busy == s:
                    self.lock.wait()
                self.rush = False

    def _past(self, s: int, first: int, steps: int) -> bool:
        """Whether an insert of ``steps`` ring steps from ``first`` writes segment ``s`` only past the end of
        its new part (the free steps after the write position): nothing to protect. O(1)."""
        r = self.ranges.get(s)
        if r is None or s != first // self.k or first < r[1]:
            return False
        return first + steps - self.capacity <= r[0]  # no wrap back into the part

    def release(self) -> None:
        """End every read of the shard's memory (the replay closes): waits for the segment being read (one
        chunk); a write still to come fails instead. Any thread; idempotent."""
        with self.lock:
            self.closed = True
            while self.busy >= 0:
                self.lock.wait()
            self.views = None

    def _next(self) -> tuple[int, np.ndarray | None] | None:
        """The next segment for the thread: a copy (written first, to free it), else a pending one (marked busy)."""
        with self.lock:
            if self.saved:
                s = min(self.saved)
                return s, self.saved.pop(s)
            if self.failure:
                raise CheckpointError(f"{self.directory}: {self.failure}")
            if self.closed and self.pending:
                raise CheckpointError(f"{self.directory}: the replay was closed before the checkpoint was written")
            while self.order:
                s = self.order.pop(0)
                if s in self.pending:
                    del self.pending[s]
                    self.busy = s
                    return s, None
            return None

    def _live(self, s: int, pacer: Pacer) -> Iterator[memoryview]:
        """Segment ``s``'s bytes from the shard's memory, in paced chunks; stops early when an insert copied it."""
        a, b = self.ranges[s]
        for part in segment_file.pieces(self.views, self.spec, a, b):
            mv = memoryview(part).cast("B")
            for x in range(0, len(mv), CHUNK):
                if not self.rush:
                    pacer.wait(min(CHUNK, len(mv) - x))
                if s in self.saved or self.closed:
                    return
                yield mv[x:x + CHUNK]


def snapshot(replay, changes: Changes, base: Base | None, path: str, copy_limit: int,
             copies: table_blocks.Copies | None = None) -> Snapshot:
    """Take this rank's snapshot for checkpoint directory ``path`` (local; the training thread).

    Args:
        replay: the :class:`~gear_mpi.replay.Replay`; changes: its :class:`Changes` (taken here);
        base: this rank's part of its previous checkpoint, or None (everything is written);
        path: the checkpoint's directory (created here if missing); copy_limit: the most bytes inserts copy
            (:meth:`Snapshot.protect`) before the thread has written the segments they overwrite;
        copies: where the table's copy goes (:class:`~gear_mpi.checkpoint.table_blocks.Copies`, kept from one
            checkpoint to the next: memory already touched, so the copy costs no page faults -- 85 MB: 0.45 s
            into fresh memory, 0.01 s into touched memory on the machine measured; the previous snapshot's
            must be written; None: fresh memory, and every table block is written).
    Returns:
        The :class:`Snapshot`; until :func:`write` ends it, hang :meth:`Snapshot.protect` on ``store.on_write``.
    Raises:
        OSError: creating the directory failed.
    Cost: a copy of the table sections and the index, compared with the base's copy; a hard link per
    unchanged segment and table block; O(segments in use) bookkeeping; no segment is copied.
    """
    shard = replay.shard
    store, spec, cap = shard.store, shard.spec, shard.capacity_steps
    changed = changes.take()
    head, used = int(store.state[ring.STEP_HEAD]), int(store.state[ring.STEPS_USED])
    d = os.path.join(path, rank_dir(replay.rank))
    os.makedirs(d, exist_ok=True)
    snap = Snapshot(d, replay.rank, copy_limit=int(copy_limit), k=changes.k, capacity=cap,
                    views=store.byte_views(), spec=spec)
    k = changes.k
    segs = segment_file.in_use(head, used, cap, k)
    for s in segs:
        a, _ = segment_file.bounds(s, k, cap)
        end = segment_file.stored_end(s, head, used, cap, k)
        low = changed.get(s, cap)  # the first step written since the base (``cap``: none)
        kept = []
        if base is not None and s in base.entries:  # the base's parts before the first step written since
            kept = [p for p in base.entries[s] if p[1] <= low]
            if kept and kept[-1][1] < end and len(kept) >= MAX_PARTS:  # one part more: too many, all again
                kept = []
        start = kept[-1][1] if kept else a
        for lo, hi, entry in kept:
            snap.links.append((segment_file.part_name(s, lo, k), os.path.join(base.directory,
                               segment_file.part_name(s, lo, k)), entry))
            snap.linked += segment_file.nbytes(spec, lo, hi)
        snap.parts[s] = [(lo, hi) for lo, hi, _ in kept]
        if start < end:
            snap.pending[s] = snap.ranges[s] = (start, end)
            snap.parts[s].append(snap.ranges[s])
            snap.changed += segment_file.nbytes(spec, *snap.ranges[s])
    # the segments just past the write position are the next an insert overwrites: written first
    tail = ((head + used) % cap) // changes.k if cap else 0
    count = (cap - 1) // changes.k + 1 if cap else 1
    snap.order = sorted(snap.pending, key=lambda s: (s - tail) % count)
    sections = shard.sections()
    keep = () if base is None else list(base.flats.values())
    snap.sections, snap.flats = (copies or table_blocks.Copies()).copy(sections, keep)
    meta = shard_files.rank_meta(shard.state(), replay.state(), sections)
    snap.stems = [stem for stem, _, _ in table_blocks.groups(meta["table_layout"])]
    meta.update(column_layout=segment_file.LAYOUT, segment_steps=k, segments=segs, table_block=table_blocks.BLOCK)
    whole = {s: [list(p) for p in ps] for s, ps in snap.parts.items()
             if ps != [segment_file.bounds(s, k, cap)]}
    if whole:
        meta["segment_parts"] = {str(s): ps for s, ps in whole.items()}
    # the links here, in the loop (about 15 us each): the writer thread takes the GIL back less often
    for fn, src, _ in snap.links:
        if not table_blocks.link(src, os.path.join(d, fn)):
            snap.link_copies.append((src, fn))
    prev = None if base is None else (base.directory, base.tables, base.flats)
    snap.table_entries, snap.table_pending, copied, snap.table_linked = table_blocks.plan(
        d, snap.stems, snap.flats, prev, table_blocks.BLOCK)
    snap.link_copies += copied
    if store.compressed:  # their chunks as stored (compressed: a fraction of the raw size), copied whole
        layout = {}
        for name, chunks in store.compressed.items():
            parts = chunks.export()
            layout[name] = [len(parts[p]) for p, _ in compressed_file.PARTS]
            snap.compressed += [np.ascontiguousarray(parts[p], dt) for p, dt in compressed_file.PARTS]
        meta["compressed"] = layout
    snap.meta = meta
    snap.items, snap.steps_used = len(shard), used
    return snap


def write(snap: Snapshot, pacer: Pacer | None = None) -> tuple[dict, Base]:
    """Write a snapshot's files and mark its directory done (any thread; no MPI).

    Args:
        snap: from :func:`snapshot`; pacer: the byte budget for the segments (None: unpaced).
    Returns:
        ``(done, base)``: what ``done.json`` says (``rank``, ``items``, ``steps_used``, ``files``), and this
        part as the base of the rank's next checkpoint.
    Raises:
        OSError: the file system refused; CheckpointError: the replay was closed first (then ``failed.json``
        is written, if it can be).
    Cost: writes the changed segments (from the shard's memory or an insert's copy) and table blocks (the
    unchanged ones were linked by :func:`snapshot`), an fsync per file.
    """
    d = snap.directory
    pacer = pacer if pacer is not None else Pacer()
    try:
        entries: dict[str, dict] = {fn: dict(entry) for fn, _, entry in snap.links}  # linked
        while True:
            nxt = snap._next()
            if nxt is None:
                break
            s, data = nxt
            name = segment_file.part_name(s, snap.ranges[s][0], snap.k)
            filename = os.path.join(d, name)
            if data is not None:  # an insert's copy: freed once on disk
                entries[name] = files.write_file_direct(filename, pacer.chunks([data]))
                del data
                continue
            try:
                entry = files.write_file_direct(filename, snap._live(s, pacer))
            finally:
                with snap.lock:
                    snap.busy = -1
                    copied, closed = s in snap.saved, snap.closed
                    snap.lock.notify_all()
            if copied or closed:  # an insert copied it while it was read (the copy is written next)
                os.unlink(filename)
                if closed and not copied:
                    raise CheckpointError(f"{d}: {snap.failure or 'the replay was closed before the checkpoint was written'}")
            else:
                entries[name] = entry
        with snap.lock:
            if snap.failure:
                raise CheckpointError(f"{d}: {snap.failure}")
            entries.update(snap.entries)  # what inserts wrote themselves
        entries.update(snap.table_entries)  # linked by snapshot()
        tables, snap.table_written = table_blocks.write_pending(d, snap.table_pending, snap.link_copies, pacer)
        entries.update(tables)
        if snap.compressed:
            entries[compressed_file.COMPRESSED] = files.write_file_direct(
                os.path.join(d, compressed_file.COMPRESSED), pacer.chunks(snap.compressed))
            snap.compressed = []
        entries[SHARD_JSON] = files.write_file(os.path.join(d, SHARD_JSON),
                                               [json.dumps(snap.meta, sort_keys=True).encode()])
        files.fsync_dir(d)
        done = {"rank": snap.rank, "items": snap.items, "steps_used": snap.steps_used, "files": entries}
        series.write_marker(d, series.DONE, done)
    except BaseException as e:
        try:
            series.write_marker(d, series.FAILED, {"rank": snap.rank, "error": f"{type(e).__name__}: {e}"})
        except Exception:
            pass
        raise
    finally:
        with snap.lock:  # nothing more to protect: inserts go on without a look
            snap.pending.clear()
            snap.saved.clear()
            snap.order.clear()
            snap.views = None
            snap.table_pending = []
    segs = {s: [(lo, hi, entries[segment_file.part_name(s, lo, snap.k)]) for lo, hi in ps]
            for s, ps in snap.parts.items()}
    tables = {n: e for n, e in entries.items() if n.startswith(table_blocks.PREFIX)}
    return done, Base(d, segs, tables, dict(zip(snap.stems, snap.flats)))

"""One rank's part of an incremental checkpoint: what changed, a cheap snapshot, and its files.

A :class:`Changes` record hangs on the shard's store (``store.on_write``) and notes which ring
segments (:mod:`~gear_mpi.checkpoint.segment_file`) each insert writes. :func:`snapshot`, called by
the training thread between two collectives, decides per segment holding steps in use:

- not written since the previous checkpoint of this rank (its *base*): a hard link to the base's file
  (its manifest entry reused, nothing read or written);
- written since (or no base): its bytes are copied into private memory now -- up to ``copy_limit``
  bytes; past that, written to its file at once from the shard's memory (the training thread waits for
  those, as for a plain save).

The table sections, the priority index and the rank's state are always copied (about 70 bytes per
slot in use). :func:`write` then runs in a thread of its own, touching only the snapshot (never the
shard, never MPI): it writes the copied segments, links the others, writes ``table.bin`` and
``shard.json``, fsyncs, and marks the rank's directory done (``done.json``,
:mod:`~gear_mpi.checkpoint.series`) -- or failed (``failed.json``).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels import ring
from . import files, segment_file, series, shard_files
from .files import SHARD_JSON, TABLE, rank_dir


class Changes:
    """The ring segments written since the last :meth:`take` (called by every insert: ``store.on_write``).

    Args:
        k: ring steps per segment; capacity: the ring's steps.
    Cost: O(1) per insert that stays in the segment of the previous one, else O(segments it spans).
    """

    def __init__(self, k: int, capacity: int):
        self.k, self.capacity = int(k), int(capacity)
        self.segments: set[int] = set()
        self._last = -1  # the segment the last insert ended in (already noted)

    def __call__(self, first: int, steps: int) -> None:
        if steps <= 0:
            return
        if steps < self.k and first // self.k == self._last and (first + steps - 1) // self.k == self._last:
            return
        seg = segment_file.touched(int(first), int(steps), self.capacity, self.k)
        self.segments.update(seg)
        self._last = seg[-1]

    def take(self) -> set[int]:
        """The segments written since the last call, and start over. O(1)."""
        out, self.segments, self._last = self.segments, set(), -1
        return out


@dataclass
class Base:
    """A rank's part of its previous checkpoint: where its files are and their manifest entries."""
    directory: str
    entries: dict[int, dict]  # segment -> {"bytes", "sha256"}


@dataclass
class Snapshot:
    """What :func:`write` needs, taken by :func:`snapshot`; no reference to the shard."""
    directory: str                   # this rank's directory of the checkpoint
    rank: int
    copies: list[tuple[int, np.ndarray]] = field(default_factory=list)   # segment -> its bytes
    links: list[tuple[int, str, dict]] = field(default_factory=list)     # segment -> base file, entry
    entries: dict[str, dict] = field(default_factory=dict)               # files already written
    sections: list[np.ndarray] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    items: int = 0
    steps_used: int = 0
    written_now: int = 0     # bytes the training thread wrote itself (past copy_limit)
    copied: int = 0          # bytes copied for the thread
    linked: int = 0          # bytes linked from the base

    @property
    def to_write(self) -> int:
        """Bytes :func:`write` will write (the copies and the table). O(copies)."""
        return self.copied + sum(int(a.nbytes) for a in self.sections)


def snapshot(replay, changes: Changes, base: Base | None, path: str, copy_limit: int) -> Snapshot:
    """Take this rank's snapshot for checkpoint directory ``path`` (local; the training thread).

    Args:
        replay: the :class:`~gear_mpi.replay.Replay`; changes: its :class:`Changes` (taken here);
        base: this rank's part of its previous checkpoint, or None (everything is written);
        path: the checkpoint's directory (created here if missing); copy_limit: bytes of changed segments
            to copy for the thread; the rest is written before this returns.
    Returns:
        The :class:`Snapshot`.
    Raises:
        OSError: creating the directory or writing a segment failed.
    Cost: a copy of each changed segment in use (up to ``copy_limit``; writes past it), of the table
    sections and the index; a dictionary of the state.
    """
    shard = replay.shard
    store, spec, cap = shard.store, shard.spec, shard.capacity_steps
    changed = changes.take()
    head, used = int(store.state[ring.STEP_HEAD]), int(store.state[ring.STEPS_USED])
    d = os.path.join(path, rank_dir(replay.rank))
    os.makedirs(d, exist_ok=True)
    snap = Snapshot(d, replay.rank)
    views = store.byte_views()
    segs = segment_file.in_use(head, used, cap, changes.k)
    for s in segs:
        a, b = segment_file.bounds(s, changes.k, cap)
        n = segment_file.nbytes(spec, a, b)
        if base is not None and s not in changed and s in base.entries:
            snap.links.append((s, os.path.join(base.directory, segment_file.name(s)), base.entries[s]))
            snap.linked += n
        elif snap.copied + n <= copy_limit:
            snap.copies.append((s, segment_file.copy(views, spec, a, b)))
            snap.copied += n
        else:
            name = segment_file.name(s)
            snap.entries[name] = files.write_file(os.path.join(d, name), segment_file.pieces(views, spec, a, b))
            snap.written_now += n
    sections = shard.sections()
    snap.sections = [np.array(arr, copy=True, order="C") for _, arr in sections]
    meta = shard_files.rank_meta(shard.state(), replay.state(), sections)
    meta.update(column_layout=segment_file.LAYOUT, segment_steps=changes.k, segments=segs)
    snap.meta = meta
    snap.items, snap.steps_used = len(shard), used
    return snap


def write(snap: Snapshot) -> tuple[dict, Base]:
    """Write a snapshot's files and mark its directory done (any thread; no shard, no MPI).

    Returns:
        ``(done, base)``: what ``done.json`` says (``rank``, ``items``, ``steps_used``, ``files``), and this
        part as the base of the rank's next checkpoint.
    Raises:
        OSError: the file system refused (then ``failed.json`` is written, if it can be).
    Cost: writes the copied segments and the table, one hard link per unchanged segment, three fsyncs.
    """
    d = snap.directory
    try:
        entries = dict(snap.entries)
        for s, src, entry in snap.links:
            dst = os.path.join(d, segment_file.name(s))
            try:
                os.link(src, dst)
            except OSError:  # no hard links here (or across file systems): a copy of the whole file
                shutil.copyfile(src, dst)
            entries[segment_file.name(s)] = dict(entry)
        while snap.copies:  # each copy freed as soon as it is on disk
            s, data = snap.copies.pop(0)
            entries[segment_file.name(s)] = files.write_file(os.path.join(d, segment_file.name(s)), [data])
            del data
        entries[TABLE] = files.write_file(os.path.join(d, TABLE), snap.sections)
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
    segs = {int(n[4:9]): e for n, e in entries.items() if n.startswith("seg-")}
    return done, Base(d, segs)

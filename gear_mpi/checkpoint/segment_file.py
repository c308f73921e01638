"""An incremental checkpoint's columns: ``seg-NNNNN.bin`` files, each one fixed range of ring steps.

Checkpoints written by :mod:`~gear_mpi.checkpoint.background` (format version 4) cut each rank's ring
into segments of ``K`` steps (``shard.json``'s ``"segment_steps"``): segment ``s`` covers ring steps
``[s*K, min((s+1)*K, capacity))`` and its file holds, for each column in the spec's order, the bytes of
those steps back to back -- the whole range, steps in use or not (compressed columns excepted: their
chunks, as stored, go to ``compressed.bin`` whole at every checkpoint). A rank's directory holds the segments
that held steps in use when the checkpoint was taken (``shard.json``'s ``"segments"``), each listed in
the manifest with its size and sha256. A step's bytes change only when an insert writes it, so a segment
no insert has touched since the previous checkpoint is that checkpoint's file again: a hard link to it,
not a copy.

Parts (format version 6): a segment may instead be stored as *parts*, consecutive files each holding
the steps ``[lo, hi)`` (same layout: each raw column's bytes of those steps back to back), listed in
``shard.json``'s ``"segment_parts"`` (``{"s": [[lo, hi], ...]}``; a segment not listed is one file of its
whole range). The first part starts at the segment's first step; steps past the last part's end held
nothing in use (they are not stored). This is how the segment at the write position is saved: the
previous checkpoint's part(s) linked, and only the steps inserts added since written as a new part
(:func:`part_name`: ``seg-NNNNN+OFFSET.bin``) -- a second checkpoint writes what was inserted, not whole
partly filled segments again.

Reading is what a version-3 ``columns.bin`` allows except mapping: :func:`read_into` (an exact restore),
:func:`verify_rank` (the sha256 of every segment) and :func:`ring_reader` (resharding).
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np

from ..errors import CheckpointError
from ..kernels import ring
from ..spec import TrajectorySpec
from .files import CheckedFile, slices

LAYOUT = "segments"  # shard.json's "column_layout"
SEGMENT_BYTES = 16 << 20  # the default size of a segment file


def name(s: int) -> str:
    """The file name of segment ``s`` inside a rank's directory (``seg-00000.bin``). O(1)."""
    return f"seg-{s:05d}.bin"


def part_name(s: int, lo: int, k: int) -> str:
    """The file name of the part of segment ``s`` that starts at ring step ``lo`` (``k`` steps per segment):
    :func:`name` for the first part, ``seg-NNNNN+OFFSET.bin`` (OFFSET: steps after the segment's first)
    for the others. O(1)."""
    off = int(lo) - int(s) * int(k)
    return name(s) if off == 0 else f"seg-{s:05d}+{off}.bin"


def parts_of(meta: dict, s: int, k: int, capacity: int) -> list[tuple[int, int]]:
    """The ring step ranges ``[lo, hi)`` of the files of segment ``s`` in a ``shard.json`` (in order). O(parts).

    Raises:
        CheckpointError: the parts listed do not tile the start of the segment.
    """
    a, b = bounds(s, k, capacity)
    listed = (meta.get("segment_parts") or {}).get(str(s))
    if listed is None:
        return [(a, b)]
    out, at = [], a
    for lo, hi in listed:
        lo, hi = int(lo), int(hi)
        if lo != at or not lo < hi <= b:
            raise CheckpointError(f"shard.json: the parts of segment {s} {listed} do not tile [{a}, {b})")
        out.append((lo, hi))
        at = hi
    if not out:
        raise CheckpointError(f"shard.json: segment {s} has no parts")
    return out


def stored_end(s: int, head: int, used: int, capacity: int, k: int) -> int:
    """Where the steps worth storing of segment ``s`` end: its last step, or the write position when the
    steps from there to the segment's end hold nothing in use (a partly filled segment). O(1)."""
    a, b = bounds(s, k, capacity)
    if used >= capacity or capacity <= 0:
        return b
    w = (head + used) % capacity
    if a < w < b and b - w <= capacity - used:  # [w, b) inside the free range [w, head)
        return w
    return b


def raw_columns(spec: TrajectorySpec) -> list:
    """The columns a segment file holds: those stored raw in the ring (a compressed column's chunks go to
    ``compressed.bin``, :mod:`~gear_mpi.checkpoint.compressed_file`), in spec order. O(columns)."""
    return [c for c in spec.columns if c.compression is None]


def step_bytes(spec: TrajectorySpec) -> int:
    """Bytes of one ring step in a segment file (the raw columns'). O(columns)."""
    return sum(c.step_bytes for c in raw_columns(spec))


def steps_per_segment(spec: TrajectorySpec, segment_bytes: int) -> int:
    """Ring steps per segment: as many as ``segment_bytes`` hold (at least one). O(columns)."""
    return max(1, int(segment_bytes) // max(1, step_bytes(spec)))


def bounds(s: int, k: int, capacity: int) -> tuple[int, int]:
    """The ring steps ``[a, b)`` of segment ``s`` (``k`` steps per segment). O(1)."""
    return s * k, min((s + 1) * k, capacity)


def in_use(head: int, used: int, capacity: int, k: int) -> list[int]:
    """The segments holding ring steps in use (``used`` steps from ``head``), ascending. O(segments)."""
    out: set[int] = set()
    for a, b in ring.ring_segments(head, used, capacity):
        out.update(range(a // k, (b - 1) // k + 1))
    return sorted(out)


def touched(first: int, steps: int, capacity: int, k: int) -> range | list[int]:
    """The segments an insert of ``steps`` steps from ring step ``first`` writes (wrapping). O(segments)."""
    if steps >= capacity:
        return range(0, (capacity - 1) // k + 1)
    end = first + steps
    if end <= capacity:
        return range(first // k, (end - 1) // k + 1)
    return list(range(first // k, (capacity - 1) // k + 1)) + list(range(0, (end - capacity - 1) // k + 1))


def nbytes(spec: TrajectorySpec, a: int, b: int) -> int:
    """The size of the file of a segment of ring steps ``[a, b)``. O(1)."""
    return (b - a) * step_bytes(spec)


def pieces(views: dict[str, np.ndarray], spec: TrajectorySpec, a: int, b: int) -> Iterator[np.ndarray]:
    """The bytes of a segment of ring steps ``[a, b)`` in file order, as views of the columns (no copy).

    Args:
        views: the store's flat byte view of each column's ring (``TrajectoryStore.byte_views``).
        spec: the spec; a, b: the segment's ring steps.
    Returns:
        Views of at most :data:`~gear_mpi.checkpoint.files.CHUNK_BYTES` each.
    """
    for c in raw_columns(spec):
        sb = c.step_bytes
        yield from slices(views[c.name][a * sb:b * sb])


def copy(views: dict[str, np.ndarray], spec: TrajectorySpec, a: int, b: int) -> np.ndarray:
    """A private copy of the bytes of segment ``[a, b)`` in file order. O(bytes)."""
    out = np.empty(nbytes(spec, a, b), np.uint8)
    pos = 0
    for part in pieces(views, spec, a, b):
        out[pos:pos + len(part)] = part
        pos += len(part)
    return out


def _check_size(chk: CheckedFile, spec: TrajectorySpec, a: int, b: int) -> None:
    if chk.size != nbytes(spec, a, b):
        chk.close()
        raise CheckpointError(f"{chk.filename}: {chk.size} bytes, but ring steps [{a}, {b}) of this spec "
                              f"hold {nbytes(spec, a, b)}")


def _segments(meta: dict) -> tuple[int, list[int]]:
    return int(meta["segment_steps"]), [int(s) for s in meta["segments"]]


def read_into(directory: str, entries: dict, shard, meta: dict, verify: bool = True) -> None:
    """Read every saved segment into ``shard``'s ring at its place (the table already restored).

    Args:
        directory: the rank's directory; entries: its manifest entries; shard: the new shard;
        meta: the rank's ``shard.json``; verify: compare each file's sha256.
    Raises:
        CheckpointError: a segment missing, of the wrong size, truncated or (``verify``) corrupted.
    Cost: one sequential read of each segment file straight into the ring.
    """
    spec, cap = shard.spec, shard.capacity_steps
    k, segs = _segments(meta)
    views = shard.store.byte_views()
    for s in segs:
        for a, b in parts_of(meta, s, k, cap):
            fn = part_name(s, a, k)
            with CheckedFile(os.path.join(directory, fn), entries.get(fn)) as chk:
                _check_size(chk, spec, a, b)
                for part in pieces(views, spec, a, b):
                    chk.read_into(part)
                if verify:
                    chk.finish()


def verify_rank(directory: str, entries: dict, meta: dict, spec: TrajectorySpec) -> None:
    """Check the size and sha256 of every segment of a rank. Local; reads each file once.

    Raises:
        CheckpointError: a segment missing, of the wrong size, or corrupted (named).
    """
    k, segs = _segments(meta)
    cap = int(meta["capacity_steps"])
    for s in segs:
        for a, b in parts_of(meta, s, k, cap):
            fn = part_name(s, a, k)
            with CheckedFile(os.path.join(directory, fn), entries.get(fn)) as chk:
                _check_size(chk, spec, a, b)
                chk.finish()


def ring_reader(directory: str, spec: TrajectorySpec, meta: dict, index: int) -> Callable[[int, int], np.ndarray]:
    """Steps of column ``index`` by their place after the oldest step in use, from the segment files.

    Args:
        directory: the rank's directory (checked first: :func:`verify_rank`); spec: the saved spec;
        meta: its ``shard.json``; index: the column's position in the spec.
    Returns:
        ``steps(offset, length)`` -> ``[length, *shape]`` (a view of one mapped segment, else a copy).
    """
    k, _ = _segments(meta)
    cap = int(meta["capacity_steps"])
    head = int(meta["state"][ring.STEP_HEAD])
    c = spec.columns[index]
    before = sum(x.step_bytes for x in spec.columns[:index] if x.compression is None)
    maps: dict[int, np.ndarray] = {}
    ranges: dict[int, list[tuple[int, int]]] = {}

    def part(p: int) -> tuple[int, int, np.ndarray]:
        """The part holding ring step ``p``: its steps ``[a, b)`` and their mapped values."""
        s = p // k
        if s not in ranges:
            ranges[s] = parts_of(meta, s, k, cap)
        for a, b in ranges[s]:
            if a <= p < b:
                break
        else:
            raise CheckpointError(f"{directory}: ring step {p} is in no stored part of segment {s}")
        if a not in maps:
            maps[a] = np.memmap(os.path.join(directory, part_name(s, a, k)), dtype=c.dtype, mode="r",
                                offset=(b - a) * before, shape=(b - a,) + c.shape)
        return a, b, maps[a]

    def steps(offset: int, length: int) -> np.ndarray:
        parts, p, left = [], (head + offset) % cap, length
        while left > 0:
            a, b, values = part(p)
            n = min(left, b - p)
            parts.append(values[p - a:p - a + n])
            left -= n
            p = 0 if p + n == cap else p + n
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty((0,) + c.shape, c.dtype)
    return steps

"""A version-3 checkpoint's ``columns.bin``: one rank's step columns laid out exactly as its arena.

The file is the arena of :func:`gear_mpi.storage.arenas.column_layout`: a 128-byte header (the
fingerprint of spec and capacity; the node fence's counter zero) and each column's whole
ring at its 64-byte aligned offset, each step at its ring position. Only the ring steps in
use are written; the rest of the file is a hole (no blocks where the file system allows
sparse files; it reads as zeros). So ``Replay.load(path, mmap=True)`` maps the file as the
shard's arena (copy-on-write, :class:`~gear_mpi.storage.file_arenas.FileArena`) with no read at all.

The checksum covers the *pieces* in this order: the header, then each column's steps in use,
oldest first, in the spec's column order (``data`` bytes in all; the manifest's ``bytes`` is
the file's size). Hashing them costs a read of every step in use; an mmap load skips it
unless asked (``verify=True``, or :func:`gear_mpi.checkpoint.verify` at any later time).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Iterator

import numpy as np

from .. import progress
from ..errors import CheckpointError
from ..kernels import ring
from ..storage.arenas import HEADER_BYTES, check_header, column_layout, write_header
from ..spec import TrajectorySpec
from . import files
from .files import CHUNK_BYTES, CheckedFile, slices

COLUMNS = "columns.bin"


def header(spec: TrajectorySpec, capacity: int) -> np.ndarray:
    """The arena header a checkpoint stores: the fingerprint, every other byte zero. O(1).

    Args:
        spec: the saved spec; capacity: its ring length in steps.
    Returns:
        ``HEADER_BYTES`` uint8.
    """
    out = np.zeros(HEADER_BYTES, np.uint8)
    write_header(out, spec, capacity)
    return out


def pieces(spec: TrajectorySpec, capacity: int, head: int, used: int) -> Iterator[tuple[int, int, int]]:
    """Where the hashed pieces of a ``columns.bin`` lie, in checksum order. O(columns).

    Args:
        spec: the saved spec; capacity: ring steps; head: the oldest ring step in use; used: steps in use.
    Returns:
        ``(column index or -1 for the header, file offset, byte count)`` for the header, then each
        column's (at most two) segments of steps in use, oldest first.
    """
    offsets, _ = column_layout(spec, capacity)
    yield -1, 0, HEADER_BYTES
    for i, c in enumerate(spec.columns):
        if c.compression is not None:  # in compressed.bin (checkpoint.compressed_file)
            continue
        for a, b in ring.ring_segments(head, used, capacity):
            yield i, offsets[c.name] + a * c.step_bytes, (b - a) * c.step_bytes


def write(filename: str, shard) -> dict:
    """Write ``shard``'s columns as a ``columns.bin`` (through :func:`files.write_file`).

    Args:
        filename: the file to create.
        shard: the rank's :class:`~gear_mpi.shard.Shard`.
    Returns:
        The manifest entry ``{"bytes", "sha256", "data"}``.
    Raises:
        OSError: writing failed.
    Cost: one sequential write per column segment of ``steps_used * step_bytes`` bytes in
    chunks of :data:`CHUNK_BYTES`, straight from the shard's memory; holes elsewhere.
    """
    spec, cap = shard.spec, shard.capacity_steps
    _, nbytes = column_layout(spec, cap)

    def chunks():
        yield 0, header(spec, cap)
        offsets, _ = column_layout(spec, cap)
        for c in spec.columns:
            if c.compression is not None:
                continue
            head, used = int(shard.store.state[ring.STEP_HEAD]), int(shard.store.state[ring.STEPS_USED])
            for (a, _b), seg in zip(ring.ring_segments(head, used, cap), shard.column_segments(c.name)):
                pos = offsets[c.name] + a * c.step_bytes
                parts = list(slices(seg))
                for k, part in enumerate(parts):
                    if k == 0:  # file-backed columns (MADV_RANDOM): ask for each chunk ahead, the next
                        shard.store.will_read(part)  # one read while this one is written
                    if k + 1 < len(parts):
                        shard.store.will_read(parts[k + 1])
                    yield pos, part
                    pos += len(part)
        yield nbytes, b""  # the file is the arena's size, holes included
    return files.write_file(filename, chunks())


def _open(filename: str, entry: dict | None, spec: TrajectorySpec, capacity: int) -> CheckedFile:
    chk = CheckedFile(filename, entry)
    _, nbytes = column_layout(spec, capacity)
    if chk.size != nbytes:
        chk.close()
        raise CheckpointError(f"{filename}: {chk.size} bytes, but the arena of this spec and capacity has {nbytes}")
    return chk


def _check_header(filename: str, got: np.ndarray, spec: TrajectorySpec, capacity: int) -> None:
    try:
        check_header(got, spec, capacity, filename)
    except ValueError as e:
        raise CheckpointError(f"{filename}: header does not match the manifest's spec and capacity ({e})") from None


def check_mappable(filename: str, entry: dict | None, spec: TrajectorySpec, capacity: int) -> None:
    """Check, without reading the steps, that ``filename`` can be mapped as this spec's arena. Local; O(1).

    Args:
        filename: a ``columns.bin``; entry: its manifest entry; spec, capacity: the saved ones.
    Raises:
        CheckpointError: not listed, missing, of the wrong size, or with another header.
    """
    with _open(filename, entry, spec, capacity) as chk:
        got = np.empty(HEADER_BYTES, np.uint8)
        chk.read_at(0, got, hashed=False)
    _check_header(filename, got, spec, capacity)


def read_into(filename: str, entry: dict | None, shard, meta: dict, verify: bool = True) -> None:
    """Read the steps in use into ``shard`` (whose table is already restored: same ring positions).

    Args:
        filename: the ``columns.bin``; entry: its manifest entry.
        shard: the new shard; meta: the rank's ``shard.json``.
        verify: compare the sha256 (False: only sizes and the header are checked).
    Raises:
        CheckpointError: missing, wrong size, another header, truncated, or (``verify``) corrupted.
    Cost: one read of ``steps_used * step_bytes`` straight into the shard's ring.
    """
    spec, cap = shard.spec, shard.capacity_steps
    with _open(filename, entry, spec, cap) as chk:
        got = np.empty(HEADER_BYTES, np.uint8)
        chk.read_at(0, got, verify)
        for c in spec.columns:
            if c.compression is not None:
                continue
            segs = shard.column_segments(c.name)
            places = [p for p in pieces(spec, cap, _head(meta), _used(meta)) if p[0] == spec.names.index(c.name)]
            for (_, pos, _n), seg in zip(places, segs):
                for part in slices(seg):
                    chk.read_at(pos, part, verify)
                    pos += len(part)
        if verify:
            chk.finish(rest=False)
    _check_header(filename, got, spec, cap)


def digest_of(read: Callable[[int, int], memoryview], spec: TrajectorySpec, capacity: int, meta: dict) -> str:
    """The sha256 of a ``columns.bin``'s pieces, read through ``read(offset, n)``. O(steps in use).

    Args:
        read: returns ``n`` bytes at ``offset``.
        spec, capacity: the saved ones; meta: the rank's ``shard.json``.
    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    for _, pos, n in pieces(spec, capacity, _head(meta), _used(meta)):
        for a in range(0, n, CHUNK_BYTES):
            part = read(pos + a, min(CHUNK_BYTES, n - a))
            h.update(part)
            progress.advance(len(part))
    return h.hexdigest()


def verify_file(filename: str, entry: dict | None, spec: TrajectorySpec, capacity: int, meta: dict) -> None:
    """Check a ``columns.bin`` whole: size, header and sha256.

    Args:
        filename: the file; entry: its manifest entry; spec, capacity: the saved ones; meta: its ``shard.json``.
    Raises:
        CheckpointError: missing, wrong size, another header, or corrupted.
    Cost: reads every step in use once, in chunks of :data:`CHUNK_BYTES` (sequential reads with
    the kernel's read-ahead: faster than paging a ``MADV_RANDOM`` mapping in).
    """
    check_mappable(filename, entry, spec, capacity)
    fd = os.open(filename, os.O_RDONLY)
    try:
        got = digest_of(lambda pos, n: os.pread(fd, n, pos), spec, capacity, meta)
    finally:
        os.close(fd)
    if got != entry["sha256"]:
        raise CheckpointError(f"{filename}: sha256 does not match the manifest (corrupted)")


def ring_reader(filename: str, spec: TrajectorySpec, capacity: int, meta: dict,
                index: int) -> Callable[[int, int], np.ndarray]:
    """Steps of column ``index`` by their place after the oldest step, from the file mapped read-only.

    Args:
        filename: the ``columns.bin`` (checked first); spec, capacity: the saved ones;
        meta: its ``shard.json``; index: the column's position in the spec.
    Returns:
        ``steps(offset, length)``: ``length`` steps starting ``offset`` steps after the oldest
        step in use, as ``[length, *shape]`` (a view of the mapping, a copy where the ring wraps).
    """
    c = spec.columns[index]
    offsets, _ = column_layout(spec, capacity)
    ring_view = np.memmap(filename, dtype=c.dtype, mode="r", offset=offsets[c.name], shape=(capacity,) + c.shape)
    head = _head(meta)

    def steps(offset: int, length: int) -> np.ndarray:
        a = (head + offset) % capacity
        if a + length <= capacity:
            return ring_view[a:a + length]
        return np.concatenate([ring_view[a:], ring_view[:a + length - capacity]])
    return steps


def _head(meta: dict) -> int:
    return int(meta["state"][ring.STEP_HEAD])


def _used(meta: dict) -> int:
    return int(meta["state"][ring.STEPS_USED])

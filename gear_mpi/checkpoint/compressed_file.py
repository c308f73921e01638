"""A rank's compressed columns in a checkpoint: ``compressed.bin``, their chunks saved as stored.

For each compressed column (:class:`gear_mpi.Compressed`), in spec order, the five arrays of
:meth:`CompressedRing.export <gear_mpi.storage.compressed.CompressedRing.export>` back to back:
``geometry`` (int64: open chunk, steps per chunk, capacity, step bytes), ``sizes`` (int64 per chunk, -1:
empty), ``crc`` (uint32 per chunk), ``open`` (the open chunk's raw bytes) and ``heap`` (the sealed chunks'
compressed bytes end to end); their lengths are in ``shard.json``'s ``"compressed"``. An exact load puts
the chunks back without recompressing them, after checking each chunk's CRC-32 (a flipped byte names the
column, the chunk's ring steps and the trajectories on them); a mapped load (``load(mmap=True)``) maps the
file copy-on-write and leaves each sealed chunk where it lies in it (no read, no copy; every read of a chunk
checks its CRC-32, and the file is guarded as ``columns.bin`` is); a resharded load decompresses the chunks of
the trajectories it moves (and the new owner compresses them again).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ..errors import CheckpointError, CorruptDataError
from ..kernels import ring
from ..spec import TrajectorySpec
from ..storage.compressed import ChunkError, CompressedRing
from ..storage.file_arenas import FileArena
from ..storage.file_guard import GuardGroup
from . import files
from .files import CheckedFile

COMPRESSED = "compressed.bin"
PARTS = (("geometry", np.int64), ("sizes", np.int64), ("crc", np.uint32), ("open", np.uint8), ("heap", np.uint8))


def write(filename: str, shard) -> tuple[dict, dict[str, list[int]]]:
    """Write ``shard``'s compressed columns to ``filename`` (compressed bytes as they are).

    Cost: one sequential write of the chunks' bytes plus a raw chunk per column. Local.
    Args:
        filename: the file to create.
        shard: the rank's :class:`~gear_mpi.shard.Shard` (with compressed columns).
    Returns:
        ``(manifest entry, layout)``: the layout (column name -> the length of each of :data:`PARTS`) goes
        into ``shard.json``.
    Raises:
        OSError: writing failed.
    """
    layout, arrays = {}, []
    for name, chunks in shard.store.compressed.items():
        parts = chunks.export()
        layout[name] = [len(parts[p]) for p, _ in PARTS]
        arrays += [np.ascontiguousarray(parts[p], dt) for p, dt in PARTS]
    return files.write_file(filename, arrays), layout


def stored_bytes(shard) -> int:
    """Bytes :func:`write` writes for ``shard``. O(columns)."""
    return sum(c.stored_bytes + c.chunk_bytes + 20 * c.n_chunks for c in shard.store.compressed.values())


def _read(filename: str, entry: dict | None, layout: dict[str, list[int]],
          use: Callable[[str, dict[str, np.ndarray]], None], verify: bool) -> None:
    with CheckedFile(filename, entry) as chk:
        for name, counts in layout.items():
            parts = {}
            for (p, dt), n in zip(PARTS, counts):
                parts[p] = np.empty(int(n), dt)
                chk.read_into(parts[p])
            use(name, parts)
        if verify:
            chk.finish()


def restore(shard, directory: str, entries: dict, meta: dict, verify: bool = True, mapped: bool = False) -> None:
    """Put the saved chunks back into ``shard`` (exact load: same capacity; its table already restored).

    Args:
        shard: the new shard; directory: the rank's checkpoint directory; entries: its manifest file entries;
        meta: its ``shard.json``.
        verify: compare the file's sha256 (reading it whole).
        mapped: map the file copy-on-write and keep the sealed chunks where they lie (``load(mmap=True)``): no
            read beyond the small per-chunk arrays (with ``verify``: one hashing pass), no CRC pass (each read
            of a chunk checks it); the file's :class:`~gear_mpi.storage.file_guard.FileGuard` joins that of
            ``columns.bin`` (``shard.hold()`` holds both).
    Cost: reads the file once; a CRC-32 pass over each column's compressed bytes; no decompression
    (``mapped``: O(chunks), the chunks' bytes read when sampled). Local.
    Raises:
        CorruptDataError: a chunk fails its checksum (naming the column, ring steps and trajectories).
        CheckpointError: the file is missing, truncated, of another layout, or (``verify``) corrupted.
    """
    filename = os.path.join(directory, COMPRESSED)
    layout = meta.get("compressed") or {}
    if sorted(layout) != sorted(shard.store.compressed):
        raise CheckpointError(f"{filename}: holds compressed columns {sorted(layout)}, the spec declares "
                              f"{sorted(shard.store.compressed)}")
    store = shard.store

    def use(name: str, parts: dict[str, np.ndarray]) -> None:
        try:
            store.compressed[name].restore(parts, lambda j: store.describe_chunk(name, j), keep=mapped,
                                           check=not mapped)
        except CorruptDataError as e:
            raise CorruptDataError(f"{filename}: {e}") from None
        except ValueError as e:
            raise CheckpointError(f"{filename}: {e}") from None

    if not mapped:
        _read(filename, entries.get(COMPRESSED), layout, use, verify)
        return
    if verify:
        check(directory, entries, meta)
    _map(filename, entries.get(COMPRESSED), layout, store, use)


def _map(filename: str, entry: dict | None, layout: dict[str, list[int]], store,
         use: Callable[[str, dict[str, np.ndarray]], None]) -> None:
    """:func:`restore` of a mapped load: ``compressed.bin`` mapped copy-on-write, guarded with ``columns.bin``."""
    if entry is None:
        raise CheckpointError(f"{filename}: not listed in the manifest")
    want = sum(int(n) * np.dtype(dt).itemsize for counts in layout.values() for (_, dt), n in zip(PARTS, counts))
    if int(entry["bytes"]) != want:
        raise CheckpointError(f"{filename}: the manifest gives {entry['bytes']} bytes, its layout {want}")
    try:
        arena = FileArena.open_private(filename, want)
    except FileNotFoundError:
        raise CheckpointError(f"{filename}: missing") from None
    except Exception as e:
        raise CheckpointError(f"{filename}: {e}") from None
    columns = store.arena
    columns.guard = GuardGroup([getattr(columns, "guard", None), arena.guard])  # closed with the columns' arena
    arena.guard = None
    pos = 0
    for name, counts in layout.items():
        parts = {}
        for (p, dt), n in zip(PARTS, counts):
            nbytes = int(n) * np.dtype(dt).itemsize
            view = arena.buffer[pos:pos + nbytes]
            parts[p] = view if p == "heap" else np.frombuffer(view.tobytes(), dt)  # the heap stays in the file
            pos += nbytes
        use(name, parts)
    arena.buffer = None  # the chunks' views keep the mapping; it goes with the last of them


def check(directory: str, entries: dict, meta: dict) -> None:
    """Check ``compressed.bin``'s size and sha256 (if the rank has compressed columns). O(file size). Local.

    Raises:
        CheckpointError: missing, of the wrong size, or corrupted.
    """
    if meta.get("compressed"):
        _read(os.path.join(directory, COMPRESSED), entries.get(COMPRESSED), meta["compressed"],
              lambda name, parts: None, True)


def ring_reader(directory: str, entries: dict, meta: dict, spec: TrajectorySpec,
                index: int) -> Callable[[int, int], np.ndarray]:
    """Steps of compressed column ``index`` by their place after the oldest step (a resharded load).

    Cost: reads the column's chunks once (checked); each call decompresses the chunks it covers.
    Returns:
        ``steps(offset, length)`` -> ``[length, *shape]`` (a new array).
    Raises:
        CheckpointError: the file is missing, truncated or corrupted.
    """
    column = spec.columns[index]
    filename = os.path.join(directory, COMPRESSED)
    cap = int(meta["capacity_steps"])
    chunks = CompressedRing(column, cap)
    got: dict[str, Any] = {}
    _read(filename, entries.get(COMPRESSED), meta.get("compressed") or {},
          lambda name, parts: got.update(parts) if name == column.name else None, True)
    if not got:
        raise CheckpointError(f"{filename}: no chunks of compressed column {column.name!r}")
    try:
        chunks.restore(got)
    except ValueError as e:
        raise CheckpointError(f"{filename}: {e}") from None
    head = int(meta["state"][ring.STEP_HEAD])

    def steps(offset: int, length: int) -> np.ndarray:
        try:
            return chunks.read_steps(head + offset + np.arange(length, dtype=np.int64))
        except ChunkError as e:
            raise CorruptDataError(f"{filename}: column {column.name!r}: compressed chunk {e.chunk}: {e.why}") from None
    return steps

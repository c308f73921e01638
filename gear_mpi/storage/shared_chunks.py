"""Compressed columns under ``memory="shm"``: each column's chunk table and chunks in a node-shared file.

A :class:`~gear_mpi.storage.compressed.CompressedRing` keeps its sealed chunks somewhere and describes them in a
table (per chunk: where its bytes are, how many, their CRC-32) beside the one raw open chunk. With
``memory="shm"`` all of it lives in one file per compressed column under ``/dev/shm``, named after the shard's
segment (:func:`segment_name`: ``gear_mpi_<hex>_cNNN``, NNN the column's place in the spec), so that a node peer
maps it and decodes the owner's chunks itself, as it reads a raw column's windows in place:

- the first :func:`table_bytes` (whole pages, reserved at creation): the open chunk's index (its own cache
  line), the ring's geometry (steps per chunk, capacity, step bytes, chunks: a peer checks them), then the
  table: ``addr`` (int64: offset of each sealed chunk's bytes from the file's start), ``size`` (int64, -1: not
  sealed), ``crc`` (uint32), and the raw open chunk;
- after it, the chunk log of :class:`~gear_mpi.storage.chunk_heap.FileChunkHeap` (sparse: its pages are the
  compressed bytes held; those freed are punched out of the tmpfs file, so ``/dev/shm`` holds compressed bytes).

The owner's ring works on views of that file (its ``base`` is the mapping's address, its ``addr`` offsets), a
peer's :class:`PeerChunks` holds read-only rings over its own mapping of it (``base``: that mapping's address).
The names go once every node peer has mapped them (the Replay unlinks them with the shard's segment:
:func:`unlink_rings`), or at close or exit: a crash leaves none, and ``gear_mpi.storage.arenas.cleanup()``
removes those of a SIGKILLed process (same ``gear_mpi_`` prefix).

Consistency is the raw columns': an owner writes its rings (chunks sealed, opened again, freed; the table and
the open chunk) only in an insert or a load, after the node fence (:meth:`NodeView.settle
<gear_mpi.distributed.node.NodeView.settle>`) has seen every peer that reads it in place finish the last
sample; a sample is collective, so no peer reads while its owner writes. On top of that every read checks a
sealed chunk's CRC-32 (a torn or corrupted chunk raises :class:`~gear_mpi.errors.CorruptDataError`, never
returns wrong data). Local: nothing here communicates.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..errors import CorruptDataError
from ..spec import TrajectorySpec
from .arenas import SHM_DIR, SharedArena
from .chunk_heap import BLOCK, FileChunkHeap
from .compressed import ChunkError, CompressedRing, gather_rings

_OPEN, _GEOMETRY, _TABLE = 0, 64, 128  # byte offsets: open chunk index, geometry (4 int64), the table


def segment_name(arena_name: str, index: int) -> str:
    """The file (in /dev/shm) of compressed column ``index`` of the shard whose segment is ``arena_name``. O(1)."""
    return f"{arena_name}_c{int(index):03d}"


def _layout(n_chunks: int, chunk_bytes: int) -> tuple[int, int, int, int, int]:
    """Byte offsets of ``addr``, ``size``, ``crc`` and the open chunk, and the table's whole pages."""
    addr = _TABLE
    size = addr + 8 * n_chunks
    crc = size + 8 * n_chunks
    opened = -(-(crc + 4 * n_chunks) // 64) * 64
    return addr, size, crc, opened, -(-(opened + chunk_bytes) // BLOCK) * BLOCK


def table_bytes(n_chunks: int, chunk_bytes: int) -> int:
    """Bytes before the chunk log: header, table and open chunk, in whole pages. O(1)."""
    return _layout(n_chunks, chunk_bytes)[4]


def _bind(ring: CompressedRing, buffer: np.ndarray, role: str) -> None:
    """Make ``ring``'s table, open chunk and open index views of ``buffer`` (a mapped file laid out by
    :func:`_layout`): ``role`` ``"owner"`` writes a new, empty table; ``"peer"`` checks the geometry.

    Raises:
        ValueError: (peer) the file was laid out for another ring.
    """
    n, cb = ring.n_chunks, ring.chunk_bytes
    a, s, c, o, end = _layout(n, cb)
    geometry = buffer[_GEOMETRY:_GEOMETRY + 32].view(np.int64)
    want = np.array([ring.k, ring.capacity, ring.sb, n], np.int64)
    if role == "owner":
        geometry[:] = want
    elif len(buffer) < end or not np.array_equal(geometry, want):
        raise ValueError(f"column {ring.name!r}: a node peer's chunk table is laid out for geometry "
                         f"{geometry.tolist() if len(buffer) >= _TABLE else '?'}, not {want.tolist()} "
                         f"(steps per chunk, capacity, step bytes, chunks)")
    addr, size = buffer[a:a + 8 * n].view(np.int64), buffer[s:s + 8 * n].view(np.int64)
    crc, cell = buffer[c:c + 4 * n].view(np.uint32), buffer[_OPEN:_OPEN + 8].view(np.int64)
    if role == "owner":
        addr[:], size[:], crc[:], cell[0] = ring.addr, ring.size, ring.crc, ring.open_index
        buffer[o:o + cb] = ring.open
    ring.addr, ring.size, ring.crc, ring._open_cell, ring.open = addr, size, crc, cell, buffer[o:o + cb]
    ring.base = int(buffer.ctypes.data)
    ring.shared = role


def share_rings(rings: Mapping[str, CompressedRing], spec: TrajectorySpec, arena_name: str) -> None:
    """Owner: put each (empty) compressed ring of ``rings`` in a node-shared file of its own (see the module
    docstring), named by :func:`segment_name`. Local; one file and mapping per column.

    Args:
        rings: column name -> its ring (empty, no heap yet).
        spec: the columns (a ring's file is numbered by its column's place).
        arena_name: the shard's shared-memory segment's name.
    Raises:
        StorageError: a file cannot be created or its table's pages reserved (the files made so far are closed).
    """
    made = []
    try:
        for i, c in enumerate(spec.columns):
            if c.name not in rings:
                continue
            ring = rings[c.name]
            heap = FileChunkHeap(SHM_DIR, segment_name(arena_name, i), ring.n_chunks, ring.chunk_bytes,
                                 prefix=table_bytes(ring.n_chunks, ring.chunk_bytes), keep_name=True)
            made.append(heap)
            _bind(ring, heap.buffer, "owner")
            ring.heap = heap
    except BaseException:
        for heap in made:
            heap.close()
        raise


def unlink_rings(rings: Mapping[str, CompressedRing]) -> None:
    """Owner: remove the names of the rings' shared files (node peers have mapped them). Idempotent; O(columns)."""
    for ring in rings.values():
        if ring.shared == "owner":
            ring.heap.unlink()


class _ChunkViews:
    """A peer ring's ``chunks``: sealed chunk ``j``'s bytes in the owner's file, or None (what the Python
    decoding path of :class:`~gear_mpi.storage.compressed.CompressedRing` reads)."""

    def __init__(self, ring: CompressedRing, buffer: np.ndarray):
        self._ring, self._buffer = ring, buffer

    def __len__(self) -> int:
        return self._ring.n_chunks

    def __getitem__(self, j: int):
        n = int(self._ring.size[j])
        if n < 0:
            return None
        at = int(self._ring.addr[j])
        return self._buffer[at:at + n]


class PeerChunks:
    """A node peer's compressed columns, read in place: one read-only ring per compressed column over this
    process's mapping of the owner's shared file, and what the sampling code asks of a store
    (:meth:`gather_compressed`, :meth:`corrupt`, :meth:`byte_views`, ``compressed``, ``capacity``).

    Args:
        spec: the columns; capacity: steps in the owner's ring.
        arena_name: the owner's segment name (``shard.shm_name``).
        views: the owner's raw columns as flat bytes (``attach_columns``'s views).
        owner: the owner's rank (named in errors).
    Raises:
        FileNotFoundError: a file is gone (its shard was closed); ValueError: laid out for another ring.
    Cost: one mmap per compressed column.
    """

    def __init__(self, spec: TrajectorySpec, capacity: int, arena_name: str, views: Mapping[str, np.ndarray],
                 owner: int):
        self.capacity, self.owner, self._views = int(capacity), int(owner), views
        self.compressed: dict[str, CompressedRing] = {}
        self._arenas: list[SharedArena] = []
        try:
            for i, c in enumerate(spec.columns):
                if c.compression is None:
                    continue
                arena = SharedArena.attach(segment_name(arena_name, i))
                self._arenas.append(arena)
                ring = CompressedRing(c, self.capacity)
                _bind(ring, arena.buffer, "peer")
                ring.chunks = _ChunkViews(ring, arena.buffer)
                self.compressed[c.name] = ring
        except BaseException:
            self.close()
            raise

    def byte_views(self) -> Mapping[str, np.ndarray]:
        """The owner's raw columns as flat bytes (mapped). O(1)."""
        return self._views

    def gather_compressed(self, starts: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray,
                          out_rows: np.ndarray, outs: Mapping[str, np.ndarray], window: int,
                          keys: np.ndarray | None = None) -> None:
        """Windows of the owner's compressed columns named in ``outs`` into batch rows, decoded here from the
        owner's chunks (as :meth:`Store.gather_compressed <gear_mpi.storage.store.Store.gather_compressed>`;
        the caller is inside a sample, so the owner does not write). Local.

        Raises:
            CorruptDataError: a chunk that fails its checksum or does not decompress (naming column, owner,
                chunk and trajectory key).
        """
        gather_rings(self.compressed, self.capacity, starts, n_valid, pad_front, out_rows, outs, window, keys,
                     self.corrupt)

    def corrupt(self, name: str, error: ChunkError, what: str) -> CorruptDataError:
        """The error for a corrupted chunk of the owner's column ``name``. O(1)."""
        ring = self.compressed[name]
        lo = error.chunk * ring.k
        return CorruptDataError(f"column {name!r}: {what} reads compressed chunk {error.chunk} (ring steps "
                                f"{lo}..{lo + ring.chunk_steps(error.chunk) - 1}) of rank {self.owner}'s shard "
                                f"in shared memory, and {error.why}: the stored data is corrupted (nothing was "
                                f"returned)")

    def close(self) -> None:
        """Unmap the owner's files (local). Idempotent."""
        self.compressed = {}
        for arena in self._arenas:
            arena.close()
        self._arenas = []

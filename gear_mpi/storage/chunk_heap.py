"""Where a compressed column's sealed chunks live with ``memory="file"``: a byte log in a file of the shard's.

A :class:`~gear_mpi.storage.compressed.CompressedRing` seals its chunks in ring order and frees each one when the
ring's head comes back to it, one lap later: first sealed, first freed. So with ``memory="file"`` each compressed
column keeps its sealed chunks in a :class:`FileChunkHeap`, a circular log of bytes in its own file
``path/rank-NNNNN/chunks-NNN.bin`` (NNN: the column's index in the spec), mapped ``MAP_SHARED`` beside the
shard's ``columns.bin``: a chunk is appended at the log's tail, and the bytes behind its head are given back to
the file system as it moves on (``fallocate(PUNCH_HOLE)``). The file is sparse: its size is the log's address
space (twice the raw ring and a little more), its blocks only the chunks held (plus what an insert reserved
ahead, see below), so the disk holds compressed bytes, not raw ones.

The rules of file memory (:mod:`gear_mpi.storage.file_arenas`) hold:

- *No SIGBUS on a full disk.* Every byte is written through the mapping only once its blocks are reserved
  (``posix_fallocate``); an insert reserves, before anything changes, the room its chunks may take at most
  (``k * step_bytes + 32`` bytes a chunk sealed, blosc2's bound), so a full disk raises
  :class:`~gear_mpi.errors.StorageError` and leaves the replay as it was; what the insert did not use is given
  back after it (:meth:`FileChunkHeap.trim`).
- *Nothing left behind.* The file is unlinked as soon as it is mapped (only its shard reads it: node peers get
  compressed windows through MPI), so a crash leaves no file and its space is freed with the process.
  (``memory="shm"`` uses the same log, after a table ``prefix``, in a file under ``/dev/shm`` whose name is
  kept until node peers have mapped it: ``keep_name``, :mod:`gear_mpi.storage.shared_chunks`.)
- As for the columns, nothing here is durable across a restart: a replay survives a restart through its
  checkpoints, which save the chunks as stored (:mod:`gear_mpi.checkpoint.compressed_file`).

Frees out of ring order (none happens in a ring written in order; a cleared store resets the log) only delay
the reclamation of their bytes: the log's address space holds ``2 * (chunks + 1)`` chunks at their largest, so
it fills only if a whole lap of chunks were freed out of order, and then an insert raises ``StorageError``.
Local: nothing here communicates.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import errno
import mmap
import os
import weakref
from collections import deque

import numpy as np

from ..errors import StorageError
from ..progress import human
from .file_arenas import close_mapping, create_exclusive, unlink_in_creator


#: blosc2's largest overhead over the raw bytes of a chunk (``BLOSC2_MAX_OVERHEAD``)
MAX_OVERHEAD = 32
BLOCK = 4096  # reservations and holes go by whole blocks of this size
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc: list = []


def _fallocate():
    """libc's ``fallocate`` (for punching holes), or None where there is none. O(1) after the first call."""
    if not _libc:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = lib.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _libc.append(fn)
        except (OSError, AttributeError):
            _libc.append(None)
    return _libc[0]


def heap_file_name(index: int) -> str:
    """The file of compressed column ``index`` (its place in the spec) in a rank's directory. O(1)."""
    return f"chunks-{int(index):03d}.bin"


class FileChunkHeap:
    """The sealed chunks of one compressed column in a sparse, mapped file (see the module docstring).

    Positions are byte counters that only grow (the file offset is ``position % span``); the chunks held lie
    in ``[head, tail)``, oldest first, and the blocks of ``[head, reserved)`` are allocated in the file.

    Args:
        directory: the rank's directory (:func:`~gear_mpi.storage.file_arenas.rank_directory`).
        filename: the file's name in it (:func:`heap_file_name`).
        n_chunks: chunks of the ring.
        chunk_bytes: raw bytes of a full chunk.
    Raises:
        StorageError: the file exists already or cannot be created.
    Cost: one create, one ``ftruncate`` (no blocks), one mmap.
    """

    def __init__(self, directory: str, filename: str, n_chunks: int, chunk_bytes: int, prefix: int = 0,
                 keep_name: bool = False):
        self.slot = int(chunk_bytes) + MAX_OVERHEAD
        self.span = -(-2 * (int(n_chunks) + 1) * self.slot // BLOCK) * BLOCK
        #: bytes before the log, reserved at once (``memory="shm"``: the chunk table node peers read)
        self.prefix = -(-int(prefix) // BLOCK) * BLOCK
        self.filename = os.path.join(directory, filename)
        fd = create_exclusive(self.filename)
        try:
            os.ftruncate(fd, self.prefix + self.span)  # sparse: blocks are reserved as chunks need them
            if self.prefix:
                try:
                    os.posix_fallocate(fd, 0, self.prefix)
                except OSError as e:
                    raise StorageError(f"cannot reserve {human(self.prefix)} for {self.filename!r}: "
                                       f"{e.strerror or e}") from None
            self._mmap = mmap.mmap(fd, self.prefix + self.span, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if hasattr(mmap, "MADV_RANDOM"):
                self._mmap.madvise(mmap.MADV_RANDOM)
        except BaseException:
            os.close(fd)
            os.unlink(self.filename)
            raise
        self._finalizer = None
        if keep_name:  # node peers map it by name: unlink() once they have (and at exit, or close, at the latest)
            self._finalizer = weakref.finalize(self, unlink_in_creator, self.filename, os.getpid())
            atexit.register(self._finalizer)
        else:
            os.unlink(self.filename)  # only this process maps it: no name is needed, none is left by a crash
        self._fd = fd
        self.buffer = np.frombuffer(self._mmap, np.uint8)
        self.head = self.tail = self.reserved = 0
        self._log: deque = deque()  # [chunk, position, size, held] in the order appended
        self._at: dict[int, list] = {}  # chunk -> its entry
        self.punches = _fallocate() is not None

    # ---- space ------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes of the chunks held. O(chunks)."""
        return sum(e[2] for e in self._at.values())

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the file's blocks this heap has reserved (and not given back). O(1)."""
        return self.reserved - self.head // BLOCK * BLOCK

    def _ranges(self, a: int, b: int):
        """The file ranges of positions ``[a, b)`` (at most two, the log wraps)."""
        while a < b:
            lo = a % self.span
            n = min(b - a, self.span - lo)
            yield self.prefix + lo, n
            a += n

    def _reserve_to(self, end: int) -> None:
        """Reserve the blocks up to position ``end`` (rounded up to a block, at most a span past the head).

        Raises:
            StorageError: the disk has no room (nothing more is reserved).
        """
        end = min(-(-end // BLOCK) * BLOCK, self.head // BLOCK * BLOCK + self.span)
        if end <= self.reserved:
            return
        try:
            for lo, n in self._ranges(self.reserved, end):
                os.posix_fallocate(self._fd, lo, n)
        except OSError as e:
            self._punch(self.reserved, end)
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StorageError(f"not enough disk for the compressed chunks of a file-backed shard in "
                                   f"{os.path.dirname(self.filename)!r}: reserving {human(end - self.reserved)} "
                                   f"failed ({e.strerror})") from None
            raise StorageError(f"cannot reserve disk for {self.filename!r}: {e.strerror or e}") from None
        self.reserved = end

    def _punch(self, a: int, b: int) -> None:
        """Give the whole blocks of positions ``[a, b)`` back to the file system (where it can)."""
        a, b = -(-a // BLOCK) * BLOCK, b // BLOCK * BLOCK
        fn = _fallocate() if self.punches else None
        if fn is None or b <= a:
            return
        for lo, n in self._ranges(a, b):
            if fn(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, lo, n) != 0:
                self.punches = False  # e.g. EOPNOTSUPP: the blocks stay reserved (at most a span)
                return

    def reserve(self, chunks: int) -> None:
        """Reserve room for ``chunks`` more chunks at their largest, before a write that seals them changes
        anything. O(1) calls to ``posix_fallocate``.

        Args:
            chunks: the chunks the write may seal.
        Raises:
            StorageError: the disk has no room (nothing changed).
        """
        self._reserve_to(self.tail + (int(chunks) + 1) * self.slot)

    def trim(self) -> None:
        """Give back the reserved blocks past the tail's (after a write: what it did not use). O(1) calls."""
        keep = -(-self.tail // BLOCK) * BLOCK
        if self.reserved > keep:
            self._punch(keep, self.reserved)
            self.reserved = max(keep, self.head // BLOCK * BLOCK)

    # ---- chunks -----------------------------------------------------------------------
    def store(self, j: int, data) -> np.ndarray:
        """Append chunk ``j``'s sealed bytes (its earlier bytes, if any, freed first).

        Args:
            j: the chunk.
            data: its compressed bytes (bytes-like).
        Returns:
            The uint8 view of the mapping that holds them (valid until chunk ``j`` is freed).
        Raises:
            StorageError: the disk has no room for them (nothing changed), or the log is full of chunks freed
                out of order (see the module docstring).
        """
        self.free(j)
        n = len(data)
        at = self.tail
        if at % self.span + n > self.span:  # a chunk is never cut by the end of the file: start it again at 0
            at += self.span - at % self.span
        if at + n - self.head > self.span:
            raise StorageError(f"{self.filename}: the compressed chunks' log is full of chunks freed out of order "
                               f"({human(self.held_bytes)} held in {human(self.span)})")
        self._reserve_to(at + n)
        lo = self.prefix + at % self.span
        view = self.buffer[lo:lo + n]
        view[:] = np.frombuffer(data, np.uint8)
        entry = [j, at, n, True]
        self._log.append(entry)
        self._at[j] = entry
        self.tail = at + n
        return view

    def free(self, j: int) -> None:
        """Forget chunk ``j``'s bytes (nothing if none are held); the blocks behind the oldest held chunk go
        back to the file system. O(1) amortised."""
        entry = self._at.pop(j, None)
        if entry is None:
            return
        entry[3] = False
        log = self._log
        while log and not log[0][3]:
            log.popleft()
        head = log[0][1] if log else self.tail
        if head > self.head:
            # never a block that also holds positions one span on (the log wraps: with a span of a few blocks,
            # the head's old block may be where the tail's newest chunks or reserved room now lie)
            self._punch(max(self.head // BLOCK * BLOCK, max(self.tail, self.reserved) - self.span), head)
            self.head = head

    def reset(self) -> None:
        """Forget every chunk and give every block back. O(chunks)."""
        self._log.clear()
        self._at.clear()
        self._punch(self.head // BLOCK * BLOCK, max(self.reserved, self.tail))
        self.head = self.tail = self.reserved = -(-max(self.reserved, self.tail) // self.span) * self.span

    def refit(self, chunk_bytes: int) -> None:
        """Forget every chunk and hold chunks of ``chunk_bytes`` raw bytes from now on (a ring cut anew). O(chunks)."""
        self.reset()
        self.slot = int(chunk_bytes) + MAX_OVERHEAD

    def unlink(self) -> None:
        """Remove the file's name (``keep_name``; nothing otherwise): mappings stay valid. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self) -> None:
        """Unmap (once no array views it) and close the file (its space goes with the last mapping), its name
        removed (``keep_name``). Idempotent."""
        self.unlink()
        self.buffer = None
        close_mapping(self._mmap)  # chunk views still alive: the mapping goes when they do
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def file_heaps(rings: dict, spec, directory: str) -> None:
    """Give each compressed column of ``rings`` (name -> :class:`~gear_mpi.storage.compressed.CompressedRing`,
    all empty) a :class:`FileChunkHeap` in ``directory``. Local; one file each.

    Raises:
        StorageError: a file cannot be created (the heaps made so far are closed).
    """
    made = []
    try:
        for i, c in enumerate(spec.columns):
            if c.name in rings:
                ring = rings[c.name]
                heap = FileChunkHeap(directory, heap_file_name(i), ring.n_chunks, ring.chunk_bytes)
                made.append(heap)
                ring.heap = heap
    except BaseException:
        for heap in made:
            heap.close()
        for ring in rings.values():
            ring.heap = None
        raise

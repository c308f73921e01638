"""Compressed columns: one column's step ring kept as compressed chunks of ``k`` consecutive ring steps.

A column declared with :class:`~gear_mpi.spec.Compressed` has no raw ring in the shard's arena. Its ring
positions are cut into chunks ``j = position // k`` (the last one shorter when ``k`` does not divide the
capacity). Every chunk is, at any time, one of:

- *sealed*: compressed by python-blosc2 (byte shuffle, then the declared codec and level) into a bytes
  object of its own, with a CRC-32 of those bytes (blosc2 chunks carry no checksum), checked on every read;
- *open*: the one chunk being written, kept raw in :attr:`CompressedRing.open` until the ring's head
  leaves it, then sealed. Opening a sealed chunk decompresses it first, so that its steps the head has
  not reached yet (older, possibly live trajectories) stay readable;
- *empty*: never written (reads as zeros, as a new ring's steps do).

The ring is written in order (inserts are FIFO along the ring), so each chunk is compressed once per lap
of the ring; no byte heap is managed here: each sealed chunk is its own allocation in process memory
(``memory="private"``; with ``"shm"`` the compressed columns stay in the owner's process memory too, see
docs/guide/storage.md), freed when its chunk is opened again.

A window is read by decompressing only the chunks it covers, each once per call however many windows
share it, in parallel on a small thread pool (blosc2 releases the GIL) when there are several, then
copying the window's steps into the batch row (a chunk a window covers whole is decompressed straight
into the batch). Local: nothing here communicates.
"""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import CorruptDataError
from ..spec import Column

#: bytes of decompression per call under which reads stay on the calling thread
PARALLEL_BYTES = 1 << 19
#: threads that decompress a sample's chunks (at most)
MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def codec_library():
    """The python-blosc2 module. O(1) after the first import.

    Raises:
        ImportError: blosc2 is not installed (``pip install gear-mpi[compress]``).
    """
    try:
        import blosc2
    except ImportError as e:
        raise ImportError("compressed columns (gear_mpi.Compressed) need python-blosc2: "
                          "pip install 'gear-mpi[compress]' (or pip install blosc2)") from e
    return blosc2


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _pool = ThreadPoolExecutor(max(1, min(MAX_THREADS, cores)), thread_name_prefix="gear-decompress")
        return _pool


class ChunkError(Exception):
    """A sealed chunk failed its checksum or did not decompress (internal: the store names the trajectory)."""

    def __init__(self, chunk: int, why: str):
        super().__init__(why)
        self.chunk, self.why = chunk, why


class CompressedRing:
    """The chunks of one compressed column over a ring of ``capacity`` steps (see the module docstring).

    Memory: the sealed chunks' compressed bytes (:attr:`stored_bytes`) plus one raw chunk (``k * step_bytes``)
    and a few bytes of table per chunk.
    Args:
        column: the column (its ``compression`` set).
        capacity: steps in the ring.
    Raises:
        ImportError: python-blosc2 is not installed.
    """

    def __init__(self, column: Column, capacity: int):
        blosc2 = codec_library()
        self.column, self.name = column, column.name
        self.sb = column.step_bytes
        self.capacity = int(capacity)
        self.k = column.compression.steps_per_chunk(self.sb, self.capacity)
        self.n_chunks = -(-self.capacity // self.k)
        self.chunks: list[bytes | None] = [None] * self.n_chunks
        self.crc = np.zeros(self.n_chunks, np.uint32)
        self.open_index = -1
        self.open = np.zeros(self.k * self.sb, np.uint8)
        self.stored_bytes = 0
        typesize = column.dtype.itemsize if column.dtype.itemsize <= 255 else 1
        self._cparams = blosc2.CParams(codec=getattr(blosc2.Codec, column.compression.codec.upper()),
                                       clevel=column.compression.level, typesize=typesize,
                                       filters=[blosc2.Filter.SHUFFLE], nthreads=1)
        self._dparams = blosc2.DParams(nthreads=1)
        self._blosc2 = blosc2
        self._local = threading.local()

    # ---- geometry ---------------------------------------------------------------------
    def chunk_steps(self, j: int) -> int:
        """Steps of chunk ``j`` (``k``, or fewer for the last). O(1)."""
        return min(self.k, self.capacity - j * self.k)

    @property
    def chunk_bytes(self) -> int:
        """Raw bytes of a full chunk. O(1)."""
        return self.k * self.sb

    # ---- writing ----------------------------------------------------------------------
    def write(self, first: int, data: np.ndarray) -> None:
        """Store ``len(data)`` steps at ring positions ``first, first + 1, ...`` (wrapping), sealing every chunk
        the writes leave. Cost: O(steps) copied, plus one compression per chunk sealed and one decompression
        per sealed chunk opened again.

        Args:
            first: the ring position of the first step.
            data: ``[steps, *shape]``, of a dtype that casts to the column's.
        """
        total = len(data)
        if total == 0:
            return
        raw = np.ascontiguousarray(data, dtype=self.column.dtype).reshape(-1).view(np.uint8)
        pos, i, sb = int(first) % self.capacity, 0, self.sb
        while i < total:
            j = pos // self.k
            lo, n = j * self.k, self.chunk_steps(j)
            if j != self.open_index:
                self._open_chunk(j)
            take = min(total - i, lo + n - pos)
            self.open[(pos - lo) * sb:(pos - lo + take) * sb] = raw[i * sb:(i + take) * sb]
            pos, i = pos + take, i + take
            if pos == lo + n:
                self.seal()
            pos %= self.capacity

    def _open_chunk(self, j: int) -> None:
        """Make chunk ``j`` the open one (sealing the one open before): its sealed bytes decompressed into
        :attr:`open` (checked) and dropped, or zeros."""
        self.seal()
        n = self.chunk_steps(j) * self.sb
        old = self.chunks[j]
        if old is None:
            self.open[:n] = 0
        else:
            self._decompress(j, self.open[:n])
            self.chunks[j] = None
            self.stored_bytes -= len(old)
        self.open_index = j

    def seal(self) -> None:
        """Compress the open chunk (if any) into its sealed bytes. O(k * step_bytes)."""
        j = self.open_index
        if j < 0:
            return
        data = self._blosc2.compress2(self.open[:self.chunk_steps(j) * self.sb], cparams=self._cparams)
        self.chunks[j] = data
        self.crc[j] = zlib.crc32(data)
        self.stored_bytes += len(data)
        self.open_index = -1

    def reset(self) -> None:
        """Forget every chunk (a cleared store). O(chunks)."""
        self.chunks = [None] * self.n_chunks
        self.crc[:] = 0
        self.open_index = -1
        self.stored_bytes = 0

    # ---- reading ----------------------------------------------------------------------
    def _decompress(self, j: int, dst: np.ndarray) -> None:
        """Chunk ``j``'s sealed bytes, checked against their CRC, decompressed into ``dst`` (its raw size).

        Raises:
            ChunkError: a checksum that differs, or bytes blosc2 cannot decompress to the chunk's size.
        """
        data = self.chunks[j]
        if zlib.crc32(data) != int(self.crc[j]):
            raise ChunkError(j, "its bytes fail their CRC-32 checksum")
        try:
            got = self._blosc2.decompress2(data, dst=dst, dparams=self._dparams)
        except Exception as e:  # blosc2 raises RuntimeError/ValueError on bad frames
            raise ChunkError(j, f"blosc2 cannot decompress it ({e})") from None
        if got is not None and got != dst.nbytes:
            raise ChunkError(j, f"it decompresses to {got} bytes, not {dst.nbytes}")

    def _scratch(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.empty(self.chunk_bytes, np.uint8)
        return buf

    def read_steps(self, positions: np.ndarray) -> np.ndarray:
        """A copy of the steps at ring ``positions``: ``[n, *shape]`` of the column's dtype. Cost: one
        decompression per chunk touched.

        Raises:
            ChunkError: a chunk touched is corrupted.
        """
        positions = np.asarray(positions, np.int64) % self.capacity
        out = np.empty(len(positions) * self.sb, np.uint8)
        self._run([(0, int(p), 1, i * self.sb) for i, p in enumerate(positions.tolist())], out)
        return out.view(self.column.dtype).reshape((len(positions),) + self.column.shape)

    def gather(self, starts: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray, out_rows: np.ndarray,
               out: np.ndarray, window: int) -> None:
        """Windows of this column into batch rows: ``out`` (this column's batch bytes, ``[rows * window *
        step_bytes]``) row ``out_rows[i]`` gets ``pad_front[i]`` zero steps, ``n_valid[i]`` steps from ring
        position ``starts[i]`` (wrapping), then zeros. Cost: one decompression per chunk covered (in parallel
        past :data:`PARALLEL_BYTES`), each delivered byte copied once; O(B) Python work.

        Raises:
            ChunkError: a chunk a window covers is corrupted (``window`` attribute: the first such window).
        """
        sb, row_bytes = self.sb, window * self.sb
        pieces = []
        for i, (s, nv, pf, r) in enumerate(zip(starts.tolist(), n_valid.tolist(), pad_front.tolist(),
                                               out_rows.tolist())):
            base = r * row_bytes
            if pf:
                out[base:base + pf * sb] = 0
            if pf + nv < window:
                out[base + (pf + nv) * sb:base + row_bytes] = 0
            pieces.append((i, s % self.capacity, nv, base + pf * sb))
        self._run(pieces, out)

    def _run(self, windows: list[tuple[int, int, int, int]], out: np.ndarray) -> None:
        """Copy each ``(window index, ring start, steps, out offset)`` from its chunks into ``out``, each
        chunk decompressed once."""
        by_chunk: dict[int, list[tuple[int, int, int, int]]] = {}
        sb, k, cap = self.sb, self.k, self.capacity
        for w, s, nv, at in windows:
            pos, left = s, nv
            while left > 0:
                j = pos // k
                lo = j * k
                take = min(left, lo + self.chunk_steps(j) - pos)
                by_chunk.setdefault(j, []).append((w, (pos - lo) * sb, at, take * sb))
                at += take * sb
                left -= take
                pos = (pos + take) % cap
        sealed = [j for j in by_chunk if j != self.open_index and self.chunks[j] is not None]
        for j in by_chunk:
            if j == self.open_index or self.chunks[j] is None:
                src = self.open if j == self.open_index else None
                for _w, a, at, nb in by_chunk[j]:
                    out[at:at + nb] = 0 if src is None else src[a:a + nb]
        if len(sealed) > 1 and len(sealed) * self.chunk_bytes >= PARALLEL_BYTES:
            for f in [_thread_pool().submit(self._fill, j, by_chunk[j], out) for j in sealed]:
                f.result()
        else:
            for j in sealed:
                self._fill(j, by_chunk[j], out)

    def _fill(self, j: int, pieces: list[tuple[int, int, int, int]], out: np.ndarray) -> None:
        n = self.chunk_steps(j) * self.sb
        try:
            if len(pieces) == 1 and pieces[0][3] == n:  # the window covers the chunk: straight into the batch
                at = pieces[0][2]
                self._decompress(j, out[at:at + n])
                return
            buf = self._scratch()[:n]
            self._decompress(j, buf)
        except ChunkError as e:
            e.window = pieces[0][0]
            raise
        for _w, a, at, nb in pieces:
            out[at:at + nb] = buf[a:a + nb]

    # ---- checkpoints ------------------------------------------------------------------
    def export(self) -> dict[str, np.ndarray]:
        """The ring's chunks as arrays, compressed bytes as they are (no recompression): ``sizes`` (int64 per
        chunk, -1: empty), ``crc`` (uint32), ``heap`` (the sealed chunks' bytes end to end, uint8),
        ``open`` (the open chunk's raw bytes, or empty) and ``geometry`` (int64: open index, k, capacity,
        step bytes). O(stored bytes) copied."""
        sizes = np.array([-1 if c is None else len(c) for c in self.chunks], np.int64)
        heap = np.frombuffer(b"".join(c for c in self.chunks if c is not None), np.uint8)
        j = self.open_index
        opened = self.open[:self.chunk_steps(j) * self.sb].copy() if j >= 0 else np.zeros(0, np.uint8)
        return {"sizes": sizes, "crc": self.crc.copy(), "heap": heap, "open": opened,
                "geometry": np.array([j, self.k, self.capacity, self.sb], np.int64)}

    def fits(self, geometry: np.ndarray) -> bool:
        """Whether an :meth:`export` of ``geometry`` has this ring's chunking (its bytes load as they are). O(1)."""
        g = np.asarray(geometry, np.int64)
        return g.shape == (4,) and [int(x) for x in g[1:]] == [self.k, self.capacity, self.sb]

    def restore(self, parts: dict[str, np.ndarray], describe: Callable[[int], str] | None = None) -> None:
        """Load an :meth:`export` of the same chunking (:meth:`fits`), every chunk's checksum checked first;
        nothing changes on an error. O(stored bytes).

        Raises:
            ValueError: sizes that do not add up or a chunking that differs.
            CorruptDataError: a chunk whose bytes fail their checksum (``describe(j)`` names it).
        """
        if not self.fits(parts["geometry"]):
            raise ValueError(f"column {self.name!r}: saved chunks of geometry {list(parts['geometry'])} do not fit "
                             f"this ring (k={self.k}, capacity={self.capacity}, step bytes={self.sb})")
        sizes = np.asarray(parts["sizes"], np.int64)
        crc = np.asarray(parts["crc"], np.uint32)
        heap = np.asarray(parts["heap"], np.uint8).reshape(-1)
        j_open = int(parts["geometry"][0])
        opened = np.asarray(parts["open"], np.uint8).reshape(-1)
        if sizes.shape != (self.n_chunks,) or crc.shape != (self.n_chunks,) or int(sizes[sizes > 0].sum()) != len(heap):
            raise ValueError(f"column {self.name!r}: saved chunk sizes do not match its heap of {len(heap)} bytes")
        if not -1 <= j_open < self.n_chunks or len(opened) != (self.chunk_steps(j_open) * self.sb if j_open >= 0 else 0):
            raise ValueError(f"column {self.name!r}: the saved open chunk does not fit this ring")
        chunks: list[bytes | None] = []
        pos = 0
        raw = heap.tobytes()
        for j, n in enumerate(sizes.tolist()):
            if n < 0:
                chunks.append(None)
                continue
            data = raw[pos:pos + n]
            pos += n
            if zlib.crc32(data) != int(crc[j]):
                where = describe(j) if describe is not None else f"chunk {j}"
                raise CorruptDataError(f"column {self.name!r}: compressed {where} fails its CRC-32 checksum "
                                       f"(the saved bytes are corrupted)")
            chunks.append(data)
        self.chunks, self.crc = chunks, crc.copy()
        self.stored_bytes = int(sizes[sizes > 0].sum())
        self.open_index = j_open
        if j_open >= 0:
            self.open[:len(opened)] = opened

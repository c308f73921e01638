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
(``memory="private"``), freed when its chunk is opened again; with ``memory="file"`` it is appended to the
column's log file instead (:attr:`CompressedRing.heap`, :mod:`gear_mpi.storage.chunk_heap`), with ``"shm"`` to
a log in a node-shared file that also holds the chunk table, so that node peers decode the chunks themselves
(:mod:`gear_mpi.storage.shared_chunks`; :attr:`CompressedRing.base` then makes :attr:`CompressedRing.addr`
offsets in that file), and after a mapped
load (``load(mmap=True)``) the chunks saved are views of the mapped checkpoint file.

A window is read by decompressing only the chunks it covers. By default the whole read is compiled
(:meth:`CompressedRing.fill`, :func:`gear_mpi.kernels.chunks.fill_windows`): one numba call per ring takes
the windows in ring order and, for each, checks its chunks' CRC-32 and decompresses them with
python-blosc2's bundled C library (``blosc2_decompress_ctx``, called by address, one context per numba
thread), in parallel over windows and outside the GIL, into a row of scratch still in cache, from which the
window's steps (and, for frames stored once, the stacks built on them: see
:func:`gear_mpi.storage.derived.fill_from_chunks`) are copied into the batch; a chunk a thread's previous
window left in its rows is not decoded again. Where that library does not load, or
with :data:`USE_KERNELS` False, the Python path decodes one chunk a call (a small thread pool when there
are several) and copies the steps. Local: nothing here communicates.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping

import numpy as np

from ..errors import CorruptDataError
from ..kernels import chunks as chunk_kernels
from ..spec import Column

#: bytes of decompression per call under which reads stay on the calling thread
PARALLEL_BYTES = 1 << 19
#: threads that decompress a sample's chunks (at most)
MAX_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
#: whether windows are decoded by the compiled kernels (:mod:`gear_mpi.kernels.chunks`) calling
#: libblosc2 directly; False (or a library that does not load) keeps the Python path, one call per chunk
USE_KERNELS = True
_decoder_state: list = []  # [] not tried yet; [None, reason] unavailable; [_Decoder]
_decode_lock = threading.RLock()  # one kernel decode at a time (the contexts are shared); nested: several columns


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


#: C-blosc2 versions (major.minor) whose header (the wheel's ``blosc2/include/blosc2.h``) was read against
#: :class:`_DParams` and the calls :class:`_Decoder` makes: 3.6.1 (python-blosc2 4.15), 3.8.0 (4.16.1)
CHECKED_LIBRARY_VERSIONS = ("3.6", "3.8")
#: what :class:`_Decoder` relies on, as those headers declare it (comments and spacing aside): another
#: version's library is called by address only where its wheel's header declares all of these the same way
CHECKED_DECLARATIONS = (
    "typedef struct { int16_t nthreads; void* schunk; blosc2_postfilter_fn postfilter; "
    "blosc2_postfilter_params *postparams; int32_t typesize; } blosc2_dparams;",
    "BLOSC_EXPORT int blosc2_decompress_ctx(blosc2_context* context, const void* src, int32_t srcsize, "
    "void* dest, int32_t destsize);",
    "BLOSC_EXPORT blosc2_context* blosc2_create_dctx(blosc2_dparams dparams);",
    "BLOSC_EXPORT blosc2_dparams blosc2_get_blosc2_dparams_defaults(void);",
    "BLOSC_EXPORT void blosc2_init(void);",
)
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _declarations(text: str) -> str:
    """C text without comments, with runs of white space as one space and none around punctuation. O(len)."""
    text = " ".join(_COMMENTS.sub(" ", text).split())
    return re.sub(r" ?([*{}();,]) ?", r"\1", text)


def library_refusal(version: str, header: str | None) -> str | None:
    """Why :class:`_Decoder` must not call a bundled C-blosc2 by address, or None where it may: its version
    (``major.minor``) is one of :data:`CHECKED_LIBRARY_VERSIONS`, or its header ``header`` (the text of the
    wheel's ``blosc2.h``; None: absent) declares every one of :data:`CHECKED_DECLARATIONS` as they do. O(len).

    Args:
        version: the library's version (``blosc2.blosclib_version``'s first word), "" when unknown.
        header: the header's text, or None.
    Returns:
        None, or the reason (it names the version and what differs).
    """
    if ".".join(version.split(".")[:2]) in CHECKED_LIBRARY_VERSIONS:
        return None
    unchecked = (f"bundled C-blosc2 {version or '(unknown version)'} is not one whose structures were checked "
                 f"({', '.join(CHECKED_LIBRARY_VERSIONS)})")
    if header is None:
        return unchecked + ", and its wheel has no blosc2.h to compare"
    text = _declarations(header)
    for declaration in CHECKED_DECLARATIONS:
        if _declarations(declaration) not in text:
            name = re.findall(r"\w+", declaration.split("(")[0])[-1]  # the function's, or the struct's last word
            return unchecked + f", and its blosc2.h declares {name} otherwise"
    return None


def _library_header(blosc2) -> str | None:
    """The text of the wheel's ``blosc2/include/blosc2.h``, or None. O(header)."""
    try:
        with open(os.path.join(os.path.dirname(blosc2.__file__), "include", "blosc2.h"), encoding="utf-8",
                  errors="replace") as f:
            return f.read()
    except OSError:
        return None


def installed_refusal(blosc2) -> str | None:
    """:func:`library_refusal` of the C library bundled with the python-blosc2 module ``blosc2``: its version
    (``blosclib_version``'s first word) and its wheel's header. O(header)."""
    version = str(getattr(blosc2, "blosclib_version", "")).split(" ")[0]
    return library_refusal(version, _library_header(blosc2))


class _DParams(ctypes.Structure):
    """C-blosc2's ``blosc2_dparams`` (include/blosc2.h of the bundled library, C-blosc2 3.6 and 3.8)."""
    _fields_ = [("nthreads", ctypes.c_int16), ("schunk", ctypes.c_void_p), ("postfilter", ctypes.c_void_p),
                ("postparams", ctypes.c_void_p), ("typesize", ctypes.c_int32)]


class _Decoder:
    """python-blosc2's bundled C library (``blosc2/lib/libblosc2.so``) loaded with ctypes, the address of its
    ``blosc2_decompress_ctx`` and one single-threaded decompression context per numba thread (kept for the
    process's life). Built once; O(numba threads).

    Raises:
        OSError: the library's declarations were not checked (:func:`installed_refusal`'s reason), or it is not
            there or lacks the functions.
    """

    def __init__(self, blosc2):
        import numba
        refusal = installed_refusal(blosc2)
        if refusal is not None:
            raise OSError(refusal)
        here = os.path.join(os.path.dirname(blosc2.__file__), "lib")
        found = sorted(glob.glob(os.path.join(here, "libblosc2.so*"))
                       + glob.glob(os.path.join(here, "libblosc2*.dylib"))
                       + glob.glob(os.path.join(here, "*blosc2*.dll")))
        if not found:
            raise OSError(f"no libblosc2 shared library under {here}")
        lib = ctypes.CDLL(found[0])
        lib.blosc2_init.restype = None
        lib.blosc2_init()
        lib.blosc2_get_blosc2_dparams_defaults.restype = _DParams
        lib.blosc2_create_dctx.restype = ctypes.c_void_p
        lib.blosc2_create_dctx.argtypes = [_DParams]
        params = lib.blosc2_get_blosc2_dparams_defaults()
        params.nthreads = 1
        self.contexts = np.array([lib.blosc2_create_dctx(params) or 0
                                  for _ in range(numba.config.NUMBA_NUM_THREADS)], np.int64)
        if not self.contexts.all():
            raise OSError("blosc2_create_dctx failed")
        self.function = int(ctypes.cast(lib.blosc2_decompress_ctx, ctypes.c_void_p).value)
        self.lib = lib  # kept loaded: the kernels call into it by address


def _decoder(blosc2) -> _Decoder | None:
    """The process's :class:`_Decoder`, or None where it cannot load (then the Python path decodes). O(1)
    after the first call."""
    with _pool_lock:
        if not _decoder_state:
            try:
                _decoder_state.append(_Decoder(blosc2))
            except (OSError, AttributeError) as e:
                _decoder_state.extend((None, str(e)))
        return _decoder_state[0]


def decoder_refusal() -> str | None:
    """Why the compiled reads do not decode here (the library refused or not loaded: :func:`_decoder`'s
    reason), or None where they do or were not tried yet. O(1)."""
    return _decoder_state[1] if len(_decoder_state) > 1 else None


#: :meth:`CompressedRing.fill`'s rule for a column's own window: one frame, offset 0, padding unused
_OWN = (np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.bool_))


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
        #: each sealed chunk's bytes: address and size (-1: not sealed), what the kernels read
        self.addr = np.zeros(self.n_chunks, np.int64)
        self.size = np.full(self.n_chunks, -1, np.int64)
        self._open_cell = np.full(1, -1, np.int64)  # the open chunk (-1: none); node peers read it (shm)
        self.open = np.zeros(self.k * self.sb, np.uint8)
        self.stored_bytes = 0
        #: what :attr:`addr` counts from: 0 (addresses), or the mapping of a chunk log whose table node peers
        #: read (``memory="shm"``: offsets from its start, :mod:`gear_mpi.storage.shared_chunks`)
        self.base = 0
        #: whether this ring's table and chunks are in a node-shared log (``"owner"``), a node peer's view
        #: of one (``"peer"``: read only), or neither (None)
        self.shared = None
        typesize = column.dtype.itemsize if column.dtype.itemsize <= 255 else 1
        self._cparams = blosc2.CParams(codec=getattr(blosc2.Codec, column.compression.codec.upper()),
                                       clevel=column.compression.level, typesize=typesize,
                                       filters=[blosc2.Filter.SHUFFLE], nthreads=1)
        self._dparams = blosc2.DParams(nthreads=1)
        self._blosc2 = blosc2
        self._local = threading.local()
        self._kernel_scratch = np.zeros(0, np.uint8)  # decoded chunks of the last kernel read (under _decode_lock)
        #: where sealed chunks live: None, each its own bytes object in process memory; ``memory="file"``: a
        #: :class:`~gear_mpi.storage.chunk_heap.FileChunkHeap` (set by :func:`~gear_mpi.storage.chunk_heap.file_heaps`)
        self.heap = None

    @property
    def open_index(self) -> int:
        """The chunk being written (raw in :attr:`open`), or -1. O(1)."""
        return int(self._open_cell[0])

    @open_index.setter
    def open_index(self, j: int) -> None:
        self._open_cell[0] = j

    def decoder(self) -> _Decoder | None:
        """The compiled decoder the kernels use (:meth:`fill`), or None where it does not load or
        :data:`USE_KERNELS` is False. O(1) after the first call."""
        return _decoder(self._blosc2) if USE_KERNELS else None

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
        if self.heap is not None:  # room for every chunk this write may seal, before anything changes
            self.heap.reserve(total // self.k + 2)
            try:
                self._write(int(first), total, raw)
            finally:
                self.heap.trim()
            return
        self._write(int(first), total, raw)

    def _write(self, first: int, total: int, raw: np.ndarray) -> None:
        pos, i, sb = first % self.capacity, 0, self.sb
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
            self._set_chunk(j, None)
            self.stored_bytes -= len(old)
        self.open_index = j

    def seal(self) -> None:
        """Compress the open chunk (if any) into its sealed bytes. O(k * step_bytes)."""
        j = self.open_index
        if j < 0:
            return
        data = self._blosc2.compress2(self.open[:self.chunk_steps(j) * self.sb], cparams=self._cparams)
        self.crc[j] = zlib.crc32(data)
        self._set_chunk(j, data)
        self.stored_bytes += len(data)
        self.open_index = -1

    def _set_chunk(self, j: int, data: bytes | None) -> None:
        """Chunk ``j``'s sealed bytes (None: none) and their place in :attr:`addr` / :attr:`size`."""
        if self.heap is not None:  # memory="file": the bytes go to the column's file (the view kept)
            if data is None:
                self.heap.free(j)
            else:
                data = self.heap.store(j, data)
        self.chunks[j] = data
        if data is None:
            self.addr[j], self.size[j] = 0, -1
        else:
            self.addr[j], self.size[j] = np.frombuffer(data, np.uint8).ctypes.data - self.base, len(data)

    def reset(self) -> None:
        """Forget every chunk (a cleared store). O(chunks)."""
        self.chunks = [None] * self.n_chunks
        self.crc[:] = 0
        self.addr[:] = 0
        self.size[:] = -1
        self.open_index = -1
        self.stored_bytes = 0
        if self.heap is not None:
            self.heap.reset()

    def close(self) -> None:
        """Close the chunks' file (``memory="file"``: its views dropped first, so that it unmaps now). Idempotent."""
        if self.heap is not None:
            self.chunks = [None] * self.n_chunks
            self.addr[:], self.size[:] = 0, -1
            self.heap.close()

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
        positions = np.asarray(positions, np.int64).reshape(-1) % self.capacity
        n = len(positions)
        out = np.empty(n * self.sb, np.uint8)
        dec = _decoder(self._blosc2) if USE_KERNELS else None
        if dec is not None:
            ones = np.ones(n, np.int64)
            self._gather_kernels(dec, positions, ones, np.zeros(n, np.int64), np.arange(n, dtype=np.int64), out, 1)
        else:
            self._run([(0, int(p), 1, i * self.sb) for i, p in enumerate(positions.tolist())], out)
        return out.view(self.column.dtype).reshape((n,) + self.column.shape)

    def gather(self, starts: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray, out_rows: np.ndarray,
               out: np.ndarray, window: int) -> None:
        """Windows of this column into batch rows: ``out`` (this column's batch bytes, ``[rows * window *
        step_bytes]``) row ``out_rows[i]`` gets ``pad_front[i]`` zero steps, ``n_valid[i]`` steps from ring
        position ``starts[i]`` (wrapping), then zeros. Cost: one CRC-32 and one decompression per sealed
        chunk covered, each delivered byte copied once: by the compiled kernels (:mod:`gear_mpi.kernels.chunks`,
        one call, no GIL, parallel over chunks and over windows past ``SERIAL_BYTES``) calling libblosc2;
        O(chunks) Python work for references held during the call; a shared scratch of ``chunks covered *
        k * step_bytes`` bytes (grown, kept). Where the library does not load (or :data:`USE_KERNELS` is
        False): one Python call per chunk (in parallel past :data:`PARALLEL_BYTES`), O(B) Python work.

        Raises:
            ChunkError: a chunk a window covers is corrupted (``window`` attribute: the first such window).
            ValueError: a window outside the ring or the batch (nothing written).
        """
        dec = _decoder(self._blosc2) if USE_KERNELS else None
        if dec is not None:
            self._gather_kernels(dec, starts, n_valid, pad_front, out_rows, out, window)
            return
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

    def _gather_kernels(self, dec: _Decoder, starts: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray,
                        out_rows: np.ndarray, out: np.ndarray, window: int) -> None:
        """:meth:`gather` by :func:`~gear_mpi.kernels.chunks.fill_windows` (:meth:`fill`, the column alone)."""
        starts = np.asarray(starts, np.int64) % self.capacity
        self.fill(dec, starts, np.zeros(len(starts), np.int64), n_valid, pad_front, out_rows, (out,), _OWN, window)

    def fill(self, dec: _Decoder, win_start: np.ndarray, before: np.ndarray, n_valid: np.ndarray,
             pad_front: np.ndarray, rows: np.ndarray, outs: tuple[np.ndarray, ...],
             columns: tuple[np.ndarray, np.ndarray, np.ndarray], window: int) -> None:
        """Windows of this ring into batch columns that read it: ``outs[c]`` (flat bytes, ``[rows, window,
        frames[c], step]``) gets, in row ``rows[i]``, window ``i``'s slots by the frame rule of
        :func:`~gear_mpi.kernels.chunks.fill_windows` (``columns = (frames, offsets, pad_zeros)``, one entry per
        column: ``(1, 0, False)`` the column's own window, a :class:`~gear_mpi.frames.DerivedColumn`'s
        ``frames``, ``offset``, ``pad == "zeros"`` its stacks). Each window's chunks are checked and decoded
        where they are copied, in one compiled call outside the GIL (parallel over windows), holding the
        process's decode lock (the contexts are shared); the caller keeps writes off the ring meanwhile (as a
        sample does). Cost: one CRC-32 and decompression per chunk a window covers (none for a chunk the
        thread's window before left in its rows); ``frames`` step copies per window step and column; O(1)
        Python work; a scratch of two chunks per numba thread, kept.

        Args:
            dec: :meth:`decoder`'s answer (not None).
            win_start, before, n_valid, pad_front, rows: int64 per window: first ring step (in the ring),
                trajectory steps before it that may be read, real steps, leading padding, batch row.
            outs: the columns' flat bytes (C-contiguous uint8); columns: their rule; window: steps per row.
        Raises:
            ChunkError: a chunk a window covers is corrupted (``window``: that window; its row is partly written).
            ValueError: a window outside the ring or the batch (nothing written).
        """
        b = len(win_start)
        if b == 0:
            return
        args = [a if a.dtype == np.int64 and a.flags.c_contiguous else np.ascontiguousarray(a, np.int64)
                for a in (win_start, before, n_valid, pad_front, rows)]
        err = np.zeros(2 * b, np.int64)
        with _decode_lock:
            need = 2 * len(dec.contexts) * self.chunk_bytes
            if len(self._kernel_scratch) < need:
                self._kernel_scratch = np.empty(need, np.uint8)
            chunk_kernels.fill_windows(dec.function, dec.contexts, self.base, self.addr, self.size, self.crc,
                                       chunk_kernels.CRC_TABLE, self.open, self.open_index, self.k, self.capacity,
                                       self.sb, *args, *columns, outs, window, self._kernel_scratch, err[:b], err[b:])
        if err[:b].any():
            i = int(np.flatnonzero(err[:b])[0])
            j = int(err[b + i])
            e = ChunkError(j, "its bytes fail their CRC-32 checksum" if err[i] == chunk_kernels.BAD_CRC else
                           f"blosc2 does not decompress it to its {self.chunk_steps(j) * self.sb} raw bytes")
            e.window = i
            raise e

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

    def _set_k(self, k: int) -> None:
        """Cut the ring into chunks of ``k`` steps instead, every chunk empty. O(chunks)."""
        self.k, self.n_chunks = k, -(-self.capacity // k)
        self.chunks = [None] * self.n_chunks
        self.crc = np.zeros(self.n_chunks, np.uint32)
        self.addr = np.zeros(self.n_chunks, np.int64)
        self.size = np.full(self.n_chunks, -1, np.int64)
        self.open, self.open_index, self.stored_bytes = np.zeros(k * self.sb, np.uint8), -1, 0
        self._local = threading.local()
        if self.heap is not None:
            self.heap.refit(self.chunk_bytes)

    def restore(self, parts: dict[str, np.ndarray], describe: Callable[[int], str] | None = None,
                keep: bool = False, check: bool = True) -> None:
        """Load an :meth:`export` of the same chunking (:meth:`fits`), every chunk's checksum checked first;
        nothing changes on an error. A column declared with ``chunk=None`` takes the saved steps per chunk
        when they differ (a checkpoint of an older default) if this ring holds nothing yet, the ring's capacity
        and step size being the same. O(stored bytes) (``keep`` and not ``check``: O(chunks)).

        Args:
            parts: the arrays of an :meth:`export`.
            describe: names chunk ``j`` in a checksum error.
            keep: the sealed chunks stay views of ``parts["heap"]`` (a mapped checkpoint file's bytes, never
                copied; a chunk sealed later is this ring's own) instead of copies (or, ``memory="file"``,
                copies in the column's file, appended oldest first).
            check: check every chunk's CRC-32 now (False: only when a read reaches it, as every read does).

        Raises:
            ValueError: sizes that do not add up or a chunking that differs.
            CorruptDataError: a chunk whose bytes fail their checksum (``describe(j)`` names it).
        """
        g = [int(x) for x in np.asarray(parts["geometry"], np.int64).reshape(-1)]
        older = (len(g) == 4 and g[1] != self.k and 1 <= g[1] <= self.capacity and g[2:] == [self.capacity, self.sb]
                 and self.column.compression.chunk is None and self.stored_bytes == 0 and self.open_index < 0)
        if older and self.shared is not None:  # a shared table's geometry is fixed (node peers mapped it):
            saved = CompressedRing(self.column, self.capacity)  # decode the saved chunks, compress them again here
            saved._set_k(g[1])
            saved.restore(parts, describe, False, check)
            self.write(0, saved.read_steps(np.arange(self.capacity, dtype=np.int64)))
            return
        if older:
            k = self.k
            self._set_k(g[1])
            try:
                self.restore(parts, describe, keep, check)
            except Exception:
                self._set_k(k)
                raise
            return
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
        raw = heap if keep else heap.tobytes()
        for j, n in enumerate(sizes.tolist()):
            if n < 0:
                chunks.append(None)
                continue
            data = raw[pos:pos + n]
            pos += n
            if check and zlib.crc32(data) != int(crc[j]):
                where = describe(j) if describe is not None else f"chunk {j}"
                raise CorruptDataError(f"column {self.name!r}: compressed {where} fails its CRC-32 checksum "
                                       f"(the saved bytes are corrupted)")
            chunks.append(data)
        self.chunks = [None] * self.n_chunks
        self.crc[:] = crc  # in place: a shared table's arrays stay where node peers read them
        self.addr[:], self.size[:] = 0, -1
        if self.heap is not None:  # appended oldest first: the chunk after the open one is the next freed
            self.heap.reset()
            first = j_open + 1 if j_open >= 0 else 0
            order = [(first + i) % self.n_chunks for i in range(self.n_chunks)]
        else:
            order = range(self.n_chunks)
        for j in order:
            if chunks[j] is not None:
                self._set_chunk(j, chunks[j])
        self.stored_bytes = int(sizes[sizes > 0].sum())
        self.open_index = j_open
        if j_open >= 0:
            self.open[:len(opened)] = opened


def gather_rings(rings: Mapping[str, "CompressedRing"], capacity: int, starts: np.ndarray, n_valid: np.ndarray,
                 pad_front: np.ndarray, out_rows: np.ndarray, outs: Mapping[str, np.ndarray], window: int,
                 keys: np.ndarray | None, corrupt: Callable[[str, "ChunkError", str], CorruptDataError]) -> None:
    """Windows of the compressed rings named in ``outs`` into batch rows: what a shard's store does for its own
    columns and a node peer does from the owner's shared chunks. Cost: per ring, one decompression per chunk
    the windows cover (:meth:`CompressedRing.gather`). Local.

    Args:
        rings: column name -> that column's compressed ring.
        capacity: ring steps (``starts`` are taken modulo it).
        starts, n_valid, pad_front, out_rows: each window's ring start, real steps, leading padding and batch row.
        outs: column name -> that column's batch bytes (flat uint8); other names are ignored.
        window: steps per window.
        keys: each window's trajectory key (for the error message), or None.
        corrupt: builds the error for a chunk that fails (column name, the ChunkError, what read it).

    Raises:
        CorruptDataError: from ``corrupt``, for a chunk that fails its checksum or does not decompress.
    """
    if not rings or len(starts) == 0:
        return
    starts = np.asarray(starts, np.int64) % capacity
    for name, ring in rings.items():
        if name not in outs:
            continue
        try:
            ring.gather(starts, n_valid, pad_front, out_rows, outs[name], window)
        except ChunkError as e:
            w = getattr(e, "window", None)
            what = f"trajectory key {int(keys[w])}" if keys is not None and w is not None else "a sampled window"
            raise corrupt(name, e, what) from None

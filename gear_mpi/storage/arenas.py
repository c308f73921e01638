"""Where a shard's step columns live: private process memory, POSIX shared memory, or files.

An *arena* is one contiguous byte region; the shard carves its columns out of it
at 64-byte aligned offsets given by :func:`column_layout`, so any process that
knows the spec and capacity can map the same columns by name.

- :class:`PrivateArena` -- an anonymous private mapping of this process (``memory="private"``,
  the default; ``"numpy"`` is its deprecated old name).
- :class:`SharedArena` -- a POSIX shared-memory segment (``/dev/shm/gear_mpi_*``)
  that other processes on the node attach to by name and read directly. The
  creator unlinks it on :meth:`close` (or at interpreter exit); attachers only
  unmap. A process killed with SIGKILL cannot unlink: ``gear_mpi.storage.arenas.cleanup()``
  removes this user's stale segments.
- :class:`~gear_mpi.storage.file_arenas.FileArena` -- a memory-mapped file under ``path=``
  (``memory="file"``: shared, node peers map it by name; ``"mapped"``: a checkpoint's
  ``columns.bin`` mapped copy-on-write, what ``Replay.load(path, mmap=True)`` builds).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import mmap
import os
import uuid
import warnings
import weakref

import numpy as np

from ..errors import MemoryBudgetError
from . import shared_pages
from .file_arenas import (COLUMNS_FILE, FileArena, NamedMapping, rank_dir_name, rank_directory,
                          unlink_in_creator, unlink_quietly)
from .huge_pages import advise_range
from ..spec import TrajectorySpec

ALIGN = 64
SHM_DIR = "/dev/shm"
SHM_PREFIX = "gear_mpi_"


HEADER_BYTES = 2 * ALIGN
# the second cache line of the header: the last sample after which this arena's owner finished
# reading its node peers' windows (int64, written by the owner only; see Replay's node fence)
READS_DONE_OFFSET = ALIGN
_MAGIC = b"GEARMPI2"


def column_layout(spec: TrajectorySpec, capacity_steps: int) -> tuple[dict[str, int], int]:
    """Byte offset of each column in an arena, and the arena's size. Cost: O(columns).

    Args:
        spec: the trajectory layout.
        capacity_steps: steps of each column ring.

    Returns:
        (column name -> byte offset, total bytes); a compressed column takes no bytes here.

    The first 128 bytes hold a header: a fingerprint (magic, spec and capacity) that
    :func:`check_header` compares when another process attaches, and on its own
    cache line the owner's "reads done" counter (``READS_DONE_OFFSET``).
    """
    offsets: dict[str, int] = {}
    pos = HEADER_BYTES
    for c in spec.columns:
        offsets[c.name] = pos
        if c.compression is None:  # a compressed column keeps its chunks elsewhere (storage.compressed)
            pos += -(-(c.step_bytes * capacity_steps) // ALIGN) * ALIGN
    return offsets, max(pos, ALIGN)


def _fingerprint(spec: TrajectorySpec, capacity_steps: int) -> bytes:
    text = json.dumps([spec.to_dict(), int(capacity_steps)], sort_keys=True).encode()
    return _MAGIC + hashlib.sha256(text).digest()[:24]


def write_header(buffer: np.ndarray, spec: TrajectorySpec, capacity_steps: int) -> None:
    """Stamp an arena with the layout it holds (the fingerprint :func:`check_header` compares).

    Args:
        buffer: the arena's bytes.
        spec: the trajectory layout.
        capacity_steps: steps of each column ring.
    """
    tag = _fingerprint(spec, capacity_steps)
    buffer[:len(tag)] = np.frombuffer(tag, np.uint8)


def reads_done_counter(buffer: np.ndarray) -> np.ndarray:
    """The arena's "reads done" counter.

    Args:
        buffer: the arena's bytes.

    Returns:
        A one-element int64 view into its header.
    """
    return buffer[READS_DONE_OFFSET:READS_DONE_OFFSET + 8].view(np.int64)


def check_header(buffer: np.ndarray, spec: TrajectorySpec, capacity_steps: int, name: str) -> None:
    """Check that an arena was laid out for exactly this spec and capacity.

    Args:
        buffer: the arena's bytes.
        spec: the expected trajectory layout.
        capacity_steps: the expected ring length.
        name: the segment's name, for the message.

    Raises:
        ValueError: not a gear_mpi arena, or another spec or capacity.
    """
    tag = _fingerprint(spec, capacity_steps)
    got = bytes(buffer[:len(tag)])
    if got[:len(_MAGIC)] != _MAGIC:
        raise ValueError(f"arena {name!r} is not a gear_mpi shard")
    if got != tag:
        raise ValueError(f"arena {name!r} holds another spec or capacity than "
                         f"{spec!r} with capacity_steps={capacity_steps}")


MEMORY_KINDS = ("private", "shm", "file", "mapped")
#: kinds whose arenas node peers map by name (and whose names the replay unlinks once they have)
SHARED_KINDS = ("shm", "file")


def memory_kind(memory: str, stacklevel: int = 2) -> str:
    """The arena kind ``memory`` names, with the deprecated ``"numpy"`` read as ``"private"``.

    Args:
        memory: ``"private"``, ``"shm"``, ``"file"``, ``"mapped"`` or ``"numpy"`` (deprecated).
        stacklevel: where the DeprecationWarning points (2: the caller of this function).

    Returns:
        The kind (``"numpy"`` read as ``"private"``).

    Raises:
        ValueError: any other value.
    """
    if memory == "numpy":
        warnings.warn('memory="numpy" is deprecated: it always meant an anonymous private mapping; '
                      'use memory="private"', DeprecationWarning, stacklevel=stacklevel)
        return "private"
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be 'private' or 'shm' (or 'file', with path=), got {memory!r}")
    return memory


class _Pages(mmap.mmap):
    """An anonymous mapping that remembers whether huge pages were asked for it (:func:`small_pages`)."""

    huge = False


def anonymous_pages(nbytes: int, huge: bool = True) -> mmap.mmap:
    """A zero-filled private anonymous mapping of ``nbytes`` (unmapped when its last user goes), with
    transparent huge pages requested from 2 MB up when ``huge`` and :attr:`PrivateArena.huge_pages` are
    set (``huge=False`` for short-lived buffers: a fresh huge page can be slow to commit). O(1): pages
    are committed when first written (a large insert's first fill on 4 KiB pages: :func:`small_pages`)."""
    pages = _Pages(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and PrivateArena.huge_pages and nbytes >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
            pages.huge = True
        except OSError:  # not offered by this kernel: plain pages
            pass
    return pages


def _mapping_of(array) -> mmap.mmap | None:
    """The mmap object under ``array`` (following ``.base`` and memoryviews' ``.obj``), or None."""
    seen = 0
    while array is not None and seen < 16:
        if isinstance(array, mmap.mmap):
            return array
        array = array.obj if isinstance(array, memoryview) else getattr(array, "base", None)
        seen += 1
    return None


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+ (refused, EINVAL, before)


def commit_pages(view: np.ndarray) -> None:
    """Commit the pages under ``view`` (C-contiguous, in an anonymous mapping of :func:`anonymous_pages`) in
    one ``madvise(MADV_POPULATE_WRITE)``, the GIL released; the contents are unchanged. Anything else (other
    memory, a kernel that refuses): nothing. Why: on this VM, committing fresh 4 KiB pages this way took
    123-159 ms per 256 MB against 240-300 ms for first writes by one thread (it batches the faults),
    so the first fill of a large insert commits each piece before it copies into it. O(pages)."""
    if view.nbytes == 0 or not view.flags.c_contiguous:
        return
    if not isinstance(_mapping_of(view), _Pages):
        return
    start = view.ctypes.data
    lo = start - start % mmap.PAGESIZE
    advise_range(lo, start + view.nbytes - lo, MADV_POPULATE_WRITE)


class small_pages:
    """A context in which pages first written in the huge-page mappings under ``arrays`` are committed as
    4 KiB pages: ``MADV_NOHUGEPAGE`` on each such mapping (:func:`anonymous_pages` with huge pages asked)
    on entry, ``MADV_HUGEPAGE`` again on exit, so that they can be merged into huge pages later
    (khugepaged goes at 16 MB per 10 s with the kernel's defaults, here; with ``$GEAR_MPI_COLLAPSE=1`` the
    insert has a background thread collapse what it wrote at once, :mod:`gear_mpi.storage.huge_pages`), and memory
    first touched after the exit gets huge pages at once, as before. Pages already committed keep what
    they have (the advice only changes what a fault allocates). Arrays on other memory are left alone.

    Why: where the hypervisor backs guest memory lazily and free 2 MB blocks go back to the host (this
    VM), a fresh huge page costs a host fault per 4 KiB under it, about twice the time per byte of
    fresh 4 KiB pages (256 MB: 450-500 ms against 240-300 ms written by one thread). A large first
    fill (:meth:`gear_mpi.storage.store.TrajectoryStore.insert_chunked`, a batch of ``OVERLAP_BYTES`` or more reaching
    memory never written) takes the cheaper pages; sampling reads them through 4 KiB TLB entries until
    khugepaged has merged them (1e7 one-step items, ``sample(65536, 1)`` right after the fill: 22.6-26.4 ms
    against 19.9-20.1 ms on huge pages here). ``$GEAR_MPI_HUGE_PAGES=always`` (:class:`PrivateArena`)
    makes this a no-op. Cost: two ``madvise`` calls per mapping (microseconds: flags only).
    """

    def __init__(self, arrays):
        maps = () if PrivateArena.first_fill_huge else (_mapping_of(a) for a in arrays)
        self.maps = [m for m in maps if m is not None and getattr(m, "huge", False)]

    def _advise(self, advice: int) -> None:
        for m in self.maps:
            try:
                m.madvise(advice)
            except (OSError, ValueError):  # closed meanwhile, or not offered: the pages are what they are
                pass

    def __enter__(self) -> "small_pages":
        self._advise(getattr(mmap, "MADV_NOHUGEPAGE", 15))
        return self

    def __exit__(self, *exc) -> None:
        self._advise(mmap.MADV_HUGEPAGE)


class PrivateArena:
    """An arena in this process's memory: an anonymous private mapping, page-aligned (so the
    64-byte column offsets fall on cache lines), zero-filled and faulted in lazily, with
    transparent huge pages requested where the kernel offers them: fewer TLB misses on the random
    window reads of sampling (here W2 B=256 sample+update 0.31 ms against 0.35-0.40 ms without,
    W3 N=1e7 14.8-15.0 against 17.5-18.2 ms). On a VM whose host backs guest memory lazily (this
    one), a fresh huge page is slow to commit (the first fill of a 610 MB ring took 1.4-1.8 s with
    them against 0.4 s without), so a large first fill commits 4 KiB pages and asks for huge pages
    again after it (:class:`small_pages`): khugepaged merges them in the background. Read at import,
    ``$GEAR_MPI_HUGE_PAGES``: ``1`` (the default) that policy; ``always`` huge pages for a large first
    fill too (``PrivateArena.first_fill_huge``: the pages sampling wants at once, a slower first fill);
    ``0`` none at all (``PrivateArena.huge_pages``). Cost: one mmap.

    Args:
        nbytes: the arena's size.
    """

    kind = "private"
    name = None
    huge_pages = os.environ.get("GEAR_MPI_HUGE_PAGES", "1") != "0"  # transparent huge pages for big arenas
    first_fill_huge = os.environ.get("GEAR_MPI_HUGE_PAGES", "1") == "always"  # and for a large first fill

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._map = anonymous_pages(self.nbytes)
        self.buffer = np.frombuffer(self._map, np.uint8, self.nbytes)

    def close(self) -> None:
        """Drop this arena's reference to the memory; it is unmapped once no view of it is left."""
        self.buffer = None
        self._map = None


def _reserve(fd: int, nbytes: int, name: str) -> None:
    """Commit a new segment's pages now (``posix_fallocate``), so a full ``/dev/shm`` fails here with a
    clear error instead of SIGBUS at the first write of a page.

    Raises:
        MemoryBudgetError: no room (the caller removes the segment).
    """
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        try:
            st = os.statvfs(SHM_DIR)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB"
        except OSError:
            free = "its free space unknown"
        raise MemoryBudgetError(
            f"cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR} for {name} ({e.strerror}; {SHM_DIR} has {free}): "
            f"give {SHM_DIR} more room (e.g. docker run --shm-size, a larger tmpfs), use memory='private' (node "
            f"peers are then served over MPI), or ask for a smaller capacity") from None


class SharedArena(NamedMapping):
    """An arena in a POSIX shared-memory segment, created or attached by name (``unlink``/``close``:
    :class:`~gear_mpi.storage.file_arenas.NamedMapping`; a Replay unlinks once every node peer has attached).

    ``SharedArena(nbytes)`` creates a new segment (this process owns and unlinks
    it); ``SharedArena.attach(name)`` maps an existing one. Every mapping sits at a 2 MB-aligned address and,
    with ``huge=True`` (a shard's columns: :func:`make_arena`), the creator merges the segment into huge pages
    (:mod:`gear_mpi.storage.shared_pages`: fewer TLB misses on the random window reads of sampling, its own and
    its node peers'). Cost: one mmap, the pages
    committed at creation (``posix_fallocate``) and collapsed (0.3-2.5 s per GB here, beyond 512 MB in the
    background).
    """

    kind = "shm"

    def __init__(self, nbytes: int, name: str | None = None, *, huge: bool = False, _attach: bool = False):
        if name is None:
            name = SHM_PREFIX + uuid.uuid4().hex[:16]
        if "/" in name or not name:
            raise ValueError(f"invalid shared-memory name {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = not _attach
        if _attach:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                raise FileNotFoundError(f"no shared-memory segment named {name!r} (was its shard closed?)") from None
            nbytes = os.fstat(fd).st_size
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if not _attach:
                os.ftruncate(fd, int(nbytes))
                _reserve(fd, int(nbytes), name)
            self.nbytes = int(nbytes)
            self._mmap = shared_pages.map_shared(fd, self.nbytes, PrivateArena.huge_pages)
        except BaseException:
            if not _attach:
                unlink_quietly(self.path)
            raise
        finally:
            os.close(fd)
        self.buffer = np.asarray(self._mmap) if isinstance(self._mmap, shared_pages.AlignedMapping) \
            else np.frombuffer(self._mmap, dtype=np.uint8)
        # the creator of a ring (huge=True) merges its committed pages into huge pages (peers' mappings then map
        # them too); small staging and registry segments, written a little at a time, are left as they are
        self._collapser = shared_pages.collapse(self._mmap) if self.owner and huge else None
        # the creator's unlink (at close, when collected, or at exit), never a forked child's (unlink_in_creator)
        self._finalizer = weakref.finalize(self, unlink_in_creator, self.path, os.getpid()) if self.owner else None
        if self.owner:
            atexit.register(self._finalizer)

    def close(self) -> None:
        """Stop the background collapse (if any), then unmap (once no array views it); the creator also
        unlinks the name. Idempotent."""
        if getattr(self, "_collapser", None) is not None:
            self._collapser.stop()
            self._collapser = None
        super().close()

    @classmethod
    def attach(cls, name: str) -> "SharedArena":
        """Map an existing segment, read-write.

        Args:
            name: the segment's name (``shard.shm_name``).

        Returns:
            The arena (this process does not own it: closing only unmaps).

        Raises:
            FileNotFoundError: no such segment (its shard was closed).
        """
        return cls(0, name, _attach=True)


HeapArena = PrivateArena  # the old name of PrivateArena


def make_arena(kind: str, nbytes: int, path=None, rank: int = 0) -> PrivateArena | SharedArena | FileArena:
    """A new arena.

    Args:
        kind: ``"private"`` (:class:`PrivateArena`), ``"shm"`` (:class:`SharedArena`, a new
            segment this process owns), ``"file"`` (a new :class:`FileArena` in
            ``path/rank-NNNNN/columns.bin``, its space reserved), ``"mapped"`` (the existing
            ``path/rank-NNNNN/columns.bin``, e.g. a checkpoint's, mapped copy-on-write) or
            ``"numpy"`` (deprecated name of ``"private"``).
        nbytes: its size.
        path: the directory of the ranks' files (``"file"`` and ``"mapped"`` only).
        rank: the shard's rank (names its directory).

    Returns:
        The arena. Cost: one mmap (and, for ``"shm"``, one file in /dev/shm; for ``"file"``,
        a file created and its blocks reserved).

    Raises:
        ValueError: an unknown ``kind``, or ``path`` given to a kind that takes none.
        StorageError: ``"file"``: ``path`` missing or not writable, the file exists, the disk is full.
        FileNotFoundError: ``"mapped"``: no such file.
    """
    kind = memory_kind(kind, stacklevel=3)
    if kind in ("private", "shm"):
        if path is not None:
            raise ValueError(f'path= is for memory="file"; memory={kind!r} takes none')
        return PrivateArena(nbytes) if kind == "private" else SharedArena(nbytes, huge=True)
    if kind == "file":
        return FileArena.create(rank_directory(path, rank), COLUMNS_FILE, nbytes)
    if path is None:
        raise ValueError('memory="mapped" needs path=, the directory holding rank-NNNNN/columns.bin')
    return FileArena.open_private(os.path.join(os.fspath(path), rank_dir_name(rank), COLUMNS_FILE), nbytes)


def attach_arena(name: str) -> SharedArena | FileArena:
    """Map another process's arena by its name: a shared-memory segment's name, or a file's absolute path.

    Args:
        name: ``shard.shm_name`` of the owner.
    Returns:
        The arena (not owned: closing only unmaps). Cost: one mmap.
    Raises:
        FileNotFoundError: no such segment or file (its shard was closed).
        ValueError: an invalid name.
    """
    return FileArena.attach(name) if name.startswith("/") else SharedArena.attach(name)


def cleanup() -> list[str]:
    """Unlink every gear_mpi shared-memory segment owned by this user.

    For use after a crash only: it removes segments that live shards still use.

    Returns:
        The names removed.
    """
    removed = []
    for name in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, name)
        if name.startswith(SHM_PREFIX) and os.stat(path).st_uid == os.getuid():
            if unlink_quietly(path):
                removed.append(name)
    return removed

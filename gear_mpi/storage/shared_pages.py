"""Node-shared segments on huge pages: a shared mapping at a 2 MB-aligned address, collapsed with ``MADV_COLLAPSE``.

A :class:`~gear_mpi.storage.arenas.SharedArena` (``memory="shm"``, the rings node peers read directly) lives
in ``/dev/shm``, a tmpfs that most kernels mount without huge pages (``huge=never``; ``shmem_enabled`` never),
so every rank read its own and its peers' windows through 4 KiB TLB entries. Sampling reads windows at random
over rings of many megabytes: on this VM (nested paging, where a TLB miss walks two page tables) a 2 MB batch
of 32 random 64 KiB windows took 146-184 us from a 256 MB segment on 4 KiB pages against 122-131 us from
private huge pages, and W1's decentralized gather at two ranks ran 20-40 us slower than the same copy in
``mode="local"`` (private memory). No administrator setting is needed to change that:
``madvise(MADV_COLLAPSE)`` (Linux 6.1+) merges a tmpfs file's pages into huge pages whatever the mount says,
provided the mapping's address and file offset agree modulo 2 MB. So the segment is mapped at a 2 MB-aligned
address (:class:`AlignedMapping`: a reservation of ``nbytes + 2 MB``, the file mapped ``MAP_FIXED`` at the
aligned place inside it, the rest given back), by its creator and by every process that attaches, and the
creator collapses it (:func:`collapse`): afterwards every mapping of it, peers' included, maps huge pages
(``ShmemPmdMapped`` in ``/proc/meminfo``). The contents never change (the kernel copies pages into a huge page
and swaps the mapping); a kernel without ``MADV_COLLAPSE``, or one that refuses, leaves 4 KiB pages.

``$GEAR_MPI_HUGE_PAGES=0`` (:attr:`~gear_mpi.storage.arenas.PrivateArena.huge_pages`) turns it off: plain
``mmap`` mappings, no collapse.

Cost of the collapse, on the creator: about 0.26 s per GB here where the host had backed the memory before
and up to 2.5 s per GB on memory it had not (a VM whose host backs guest memory lazily); the first
:data:`COLLAPSE_NOW_BYTES` are collapsed in the constructor, anything beyond by a daemon thread, 16 MB a call
(:class:`~gear_mpi.storage.huge_pages.Collapser`), so that a large segment does not hold up the job's start.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

from .huge_pages import HUGE_PAGE, LIBC, Collapser, advise_range

#: bytes of a new segment collapsed before its constructor returns (the rest in the background)
COLLAPSE_NOW_BYTES = 512 << 20
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_FAILED = ctypes.c_void_p(-1).value

try:
    _mmap = LIBC.mmap
    _mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    _mmap.restype = ctypes.c_void_p
    _munmap = LIBC.munmap
    _munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _munmap.restype = ctypes.c_int
except AttributeError:  # no C library to call (LIBC is None): plain mmap objects
    _mmap = _munmap = None


def _unmap(address: int, nbytes: int) -> None:
    _munmap(address, nbytes)


class AlignedMapping:
    """``nbytes`` of the file ``fd`` (from offset 0) mapped shared read-write at a 2 MB-aligned address.

    Views take it as their base (``np.asarray(mapping)``: the array interface), so the memory stays mapped
    while any view of it lives and is unmapped when the last goes (as an ``mmap.mmap`` with exports);
    :meth:`close` drops nothing itself. Build it with :func:`map_shared`.

    Attributes:
        address: the mapping's first byte; nbytes: its length.
    """

    def __init__(self, address: int, nbytes: int):
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.__array_interface__ = {"data": (self.address, False), "shape": (self.nbytes,), "typestr": "|u1",
                                    "version": 3}
        self._finalizer = weakref.finalize(self, _unmap, self.address, self.nbytes)
        self._finalizer.atexit = False  # the process's exit unmaps it; views may still be read until then

    def close(self) -> None:
        """Nothing to do now: the memory is unmapped once this object and every view of it are gone. O(1)."""

    def madvise(self, advice: int, start: int = 0, length: int | None = None) -> None:
        """``madvise`` over ``[start, start + length)`` of the mapping (all of it by default), as ``mmap.madvise``.

        Raises:
            OSError: the kernel refused.
        """
        n = self.nbytes - start if length is None else length
        if not advise_range(self.address + start, n, advice):
            raise OSError(f"madvise({advice}) refused or not known to this kernel")


def map_shared(fd: int, nbytes: int, huge: bool) -> mmap.mmap | AlignedMapping:
    """Map ``nbytes`` of the file ``fd`` shared read-write: at a 2 MB-aligned address (:class:`AlignedMapping`)
    when ``huge`` and the segment holds at least one huge page, else (or when the aligned mapping fails) as a
    plain ``mmap.mmap``. O(1): one reservation, one mapping, up to two unmaps of the reservation's ends.

    Raises:
        OSError: the plain mapping failed.
    """
    if huge and _mmap is not None and nbytes >= HUGE_PAGE:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        reserve = nbytes + HUGE_PAGE
        base = _mmap(None, reserve, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base is not None and base != _MAP_FAILED:
            aligned = -(-base // HUGE_PAGE) * HUGE_PAGE
            got = _mmap(aligned, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            if got == aligned:
                if aligned > base:
                    _munmap(base, aligned - base)
                tail = aligned + nbytes
                if base + reserve > tail:
                    _munmap(tail, base + reserve - tail)
                return AlignedMapping(aligned, nbytes)
            _munmap(base, reserve)
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def collapse(mapping: mmap.mmap | AlignedMapping, now_bytes: int = COLLAPSE_NOW_BYTES) -> Collapser | None:
    """Merge a new segment's pages (committed already: ``posix_fallocate``) into huge pages: ask for them
    (``MADV_HUGEPAGE``, so khugepaged keeps them), collapse the first ``now_bytes`` now and hand the rest
    to a :class:`~gear_mpi.storage.huge_pages.Collapser` thread. Nothing for a plain ``mmap.mmap`` (its
    address is not aligned) or a kernel without the advice. The caller stops the returned thread before
    the mapping goes. Cost: see the module docstring; the call itself holds no lock other processes wait on.

    Returns:
        The background collapser, or None when nothing is left for one.
    """
    if not isinstance(mapping, AlignedMapping):
        return None
    try:
        mapping.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
    except OSError:
        return None
    collapser = Collapser([(mapping.address, mapping.nbytes)], force=True, now_bytes=now_bytes)
    return None if collapser.thread is None else collapser

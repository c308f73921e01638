"""Merging a large first fill's pages into transparent huge pages now, in the background (``MADV_COLLAPSE``).

A large first fill commits 4 KiB pages (:class:`gear_mpi.storage.arenas.small_pages`: on a VM whose host
backs guest memory lazily, this one, a fresh huge page costs about twice as much per byte), and
sampling then reads them through 4 KiB TLB entries until khugepaged merges them, about 16 MB per
10 s at the kernel's default pace: minutes for a ring of gigabytes. On 4 KiB pages the table rows
alone made W3 (N=1e7, B=65536, sample + update) slower: 30.3 / 21.9 ms a cycle on 1 / 2 threads
against 28.1 / 18.9 ms with huge pages (h15d, 2026-12-02). :class:`Collapser` asks the kernel to
merge the ranges an insert wrote (``madvise(MADV_COLLAPSE)``, Linux 6.1+, 16 MB a call) from a
daemon thread, so the insert returns at once and sampling soon reads huge pages. The contents
never change (the kernel copies the pages into a huge page and swaps the mapping); only ranges
written already are given (a collapse would commit memory under never-written pages), rounded
inwards to 2 MB. On by default (``$GEAR_MPI_COLLAPSE=0`` turns it off: :data:`ENABLED`): it pays for sampling
that follows a bulk load (W3 above; N = 1e7, 2 threads, 2026-12-04: 7.1-7.6 ms a step on the fill's 4 KiB
pages against 6.85 ms collapsed). So that it does not slow the inserts that follow one another in a bulk
load, the thread waits, before each chunk, while its owner says it is busy (``busy``: an insert running,
or a large one ended less than 0.1 s ago: :meth:`gear_mpi.storage.store.TrajectoryStore.insert_busy`).
A kernel without ``MADV_COLLAPSE``: nothing happens. Cost: one core for about the time of copying the
ranges once (about 0.5 s per 256 MB here), in the background, between inserts.
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Callable

MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
CHUNK_BYTES = 16 << 20  # per madvise call: how long stop() may wait, and an insert starting meanwhile
# Once opt-in ($GEAR_MPI_COLLAPSE=1): the thread competed with what follows the insert for memory bandwidth and a
# core (bench_offline part a, 2026-12-02: warm inserts right after a cold one took 0.37-0.43 s against 0.24-0.25 s
# for 1e7 one-step items, T=1000 hopper 53-57 % of memcpy against 78-86 %); now it waits while inserts run.
ENABLED = os.environ.get("GEAR_MPI_COLLAPSE", "1") != "0"
IDLE_POLL_S = 0.01  # how often a waiting thread asks its owner again


try:  # the C library, for madvise (and shared_pages' mmap) on any address range, the GIL released (ctypes.CDLL)
    LIBC = ctypes.CDLL(None, use_errno=True)
    _madvise = LIBC.madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # no C library to call: advise_range does nothing
    LIBC = _madvise = None


def advise_range(address: int, nbytes: int, advice: int) -> bool | None:
    """``madvise(address, nbytes, advice)``, the GIL released: True when done, False when refused, None when
    the kernel does not know ``advice`` (EINVAL) or there is no C library to call. O(pages) for some advice."""
    if _madvise is None:
        return None
    if _madvise(address, nbytes, advice) == 0:
        return True
    return None if ctypes.get_errno() == 22 else False


def weak_busy(owner) -> Callable[[], bool]:
    """``owner.insert_busy()`` through a weak reference (False once ``owner`` is gone), for :class:`Collapser`'s
    ``busy``: a collapse thread does not keep its store alive. O(1) a call."""
    ref = weakref.ref(owner)

    def busy() -> bool:
        o = ref()
        return o is not None and o.insert_busy()
    return busy


class Collapser:
    """Collapses ``ranges`` (``(address, nbytes)`` of memory already written, in mappings advised
    ``MADV_HUGEPAGE``: anonymous private ones, or node-shared segments of :mod:`~gear_mpi.storage.shared_pages`)
    into huge pages: the first ``now_bytes`` on the caller's thread, the rest from a daemon thread, one
    :data:`CHUNK_BYTES` chunk a call.

    The owner calls :meth:`stop` before it unmaps any of that memory. Local; no collective.

    Args:
        ranges: the written ranges; each is rounded inwards to whole 2 MB pages (smaller ones dropped).
        force: start the thread whatever ``$GEAR_MPI_COLLAPSE`` says (:data:`ENABLED`).
        busy: asked before each chunk of the thread; while it returns True the thread waits (polling every
            :data:`IDLE_POLL_S`). None: never waits.
        now_bytes: bytes collapsed before the constructor returns (whatever ``busy`` says).
    """

    def __init__(self, ranges, force: bool = False, busy: Callable[[], bool] | None = None, now_bytes: int = 0):
        self.ranges = [(lo, hi) for lo, hi in ((-(-a // HUGE_PAGE) * HUGE_PAGE, (a + n) // HUGE_PAGE * HUGE_PAGE)
                                               for a, n in ranges) if hi > lo]
        self.collapsed = 0  # bytes the kernel merged
        self.failed = 0  # bytes it refused (busy, out of huge pages, not supported)
        self._left = list(self.ranges)  # what is still to collapse (only the thread changes it once started)
        self._stop = threading.Event()
        self._busy = busy
        self.thread = None
        if now_bytes > 0:
            self._advance(now_bytes, waits=False)
        if self._left and (ENABLED or force):
            self.thread = threading.Thread(target=self._run, name="gear_mpi-collapse", daemon=True)
            self.thread.start()

    def _advance(self, budget: int, waits: bool) -> None:
        """Collapse chunks from the front of what is left of :attr:`ranges` until ``budget`` bytes are done, the
        ranges end, :meth:`stop` is called or the kernel turns out not to know the advice (then nothing is left
        to do). ``waits``: wait while ``busy`` says so before each chunk."""
        while self._left and budget > 0:
            if waits:
                while self._busy is not None and self._busy() and not self._stop.is_set():
                    self._stop.wait(IDLE_POLL_S)
            if self._stop.is_set():
                return
            lo, hi = self._left[0]
            n = min(CHUNK_BYTES, hi - lo, max(HUGE_PAGE, budget // HUGE_PAGE * HUGE_PAGE))
            ok = advise_range(lo, n, MADV_COLLAPSE)
            if ok is None:  # the kernel does not know MADV_COLLAPSE
                self._left = []
                return
            if ok:
                self.collapsed += n
            else:
                self.failed += n
            budget -= n
            self._left[0:1] = [(lo + n, hi)] if lo + n < hi else []

    def _run(self) -> None:
        self._advance(1 << 62, waits=True)

    def done(self) -> bool:
        """Whether the thread has finished (or never started). O(1)."""
        return self.thread is None or not self.thread.is_alive()

    def stop(self) -> None:
        """Stop after the call in progress and wait for it (at most one ``CHUNK_BYTES`` collapse). Idempotent."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join()

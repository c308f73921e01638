"""When a kernel's work pays for waking numba's workers, and running it on the calling thread alone where not.

``import gear_mpi`` lets idle workers sleep (``OMP_WAIT_POLICY=PASSIVE``, :mod:`gear_mpi.threads`), so each
parallel region of a kernel wakes them: about 65 us a region on the reference VM (docs/BENCHMARKS.md,
"Parallel copies that do not wait for a late thread"), a few microseconds on most bare-metal hosts. Below
``THREADS_MIN_ITEMS`` items a draw or a priority update does not pay for it there, while a copy of
``gather.COPY_THREADS_BYTES`` or more still does. :func:`caller_alone` sets the calling thread's numba count to 1
around such a call (numba's count is per calling thread: other threads' calls are unaffected); the caller gives
it back with :func:`give_back` in a ``finally``. Local, O(1).

One thread / two on the reference VM, us: a one-call sample of one-float items over N = 1e6, B = 512: 64-69 /
108-113, 2048: 176-186 / 203-216, 8192: 625-670 / 681-756, 16384: 1146-1222 / 1131-1233, 65536: 4512-4696 /
3442-3642; a priority update of B keys that were not just sampled, B = 1024: 53-55 / 125, 4096: 168-171 /
201-211, 16384: 692-699 / 568-594; a plain-path sample (N = 1e5), B = 1024: 89-91 / 162-172, 4096: 266 /
333-353, 16384: 948-966 / 967-982.
"""
from __future__ import annotations

import numba

from .gather import COPY_THREADS_BYTES

#: from this many items a draw or an update pays for waking the workers (below it, with less than
#: ``COPY_THREADS_BYTES`` to copy, :func:`caller_alone` keeps the call on the calling thread)
THREADS_MIN_ITEMS = 16384


def caller_alone(items: int, parallel_from: int, copy_bytes: int = 0) -> int:
    """Run the next kernel call on the calling thread alone where its threads would not pay: ``items`` in
    ``[parallel_from, THREADS_MIN_ITEMS)`` (from ``parallel_from`` the kernel opens a parallel region) and
    ``copy_bytes`` under ``COPY_THREADS_BYTES``.

    Args:
        items: the call's batch size (draws, keys).
        parallel_from: the fewest items with which the kernel opens a parallel region.
        copy_bytes: bytes the call copies besides (0 for none).
    Returns:
        The count to give back (:func:`give_back`) after the call, or 0 where nothing changed. O(1).
    """
    if items < parallel_from or items >= THREADS_MIN_ITEMS or copy_bytes >= COPY_THREADS_BYTES:
        return 0
    threads = numba.get_num_threads()
    if threads == 1:
        return 0
    numba.set_num_threads(1)
    return threads


def give_back(threads: int) -> None:
    """Restore the count :func:`caller_alone` returned (nothing for 0). O(1)."""
    if threads:
        numba.set_num_threads(threads)

"""Large host batches' memory, kept for the next batch of the same size once nothing refers to it.

A sample that returns a new :class:`~gear_mpi.batch.Batch` allocates its buffers in one numpy allocation
(``Batch.empty``). Past glibc's largest ``mmap`` threshold (32 MiB on 64-bit Linux) every such allocation is a
fresh mapping: the kernel maps and zeroes each page when the sample's copy first touches it, and unmaps it when
the batch is dropped, so a loop of ``replay.sample(B, W)`` over image windows pays the page faults and the
zeroing of the whole batch on every call (``bench_shard``: 256 windows of 64 steps of 4 KiB, a 64 MiB batch, 9.8
ms a call into a new batch against 3.5 ms into ``out=``). Here such an allocation is kept in a small pool and
handed to the next batch of the same size once no array, tensor or batch refers to it any more: the pages are
mapped and written already, and the copy runs as into ``out=``.

When a buffer may be reused: its reference count shows only the pool's own references. Every array carved from
it (a batch's columns, mask, keys, probabilities, weights, and any numpy view of them) holds a reference to it as
its ``base``; a torch tensor made from one holds the array; a copy or a pickle of a batch allocates its own. So
nothing a caller can still reach through Python reads or writes a buffer the pool hands out again. (A raw
address kept past the batch's life, as ``Batch.column_addresses`` returns, is a dangling pointer with or without
the pool.)

What it holds: at most :data:`KEEP` buffers (a training loop that keeps the previous batch while it samples the
next needs two), each of at least :data:`MIN_BYTES` and at most :data:`MAX_BYTES`; the oldest is let go when a
new size comes. Idle memory is therefore at most ``KEEP`` times the largest batch sampled lately.
``GEAR_MPI_BATCH_POOL=0`` turns the pool off (every batch its own allocation, as numpy gives it);
:func:`release` lets go of the idle buffers now. Thread-safe (one lock, taken only for allocations of
``MIN_BYTES`` or more); a forked child starts with an empty pool; local, no communication.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

ENV = "GEAR_MPI_BATCH_POOL"
#: allocations from this size on are pooled: glibc maps anything larger than 32 MiB afresh on every call (its
#: ``mmap`` threshold's ceiling); below it, freed memory mostly stays on the heap and is reused already
MIN_BYTES = 32 << 20
#: larger allocations are never kept (a one-off huge batch is not held once it is dropped)
MAX_BYTES = 4 << 30
#: buffers kept at most (in use or idle)
KEEP = 2

_lock = threading.Lock()
_kept: list[np.ndarray] = []  # oldest first


def _refs(kept: list, i: int) -> int:
    """The reference count of ``kept[i]`` as this module sees it (the list's, a local name's, the call's)."""
    buf = kept[i]
    return sys.getrefcount(buf)


#: what :func:`_refs` reads for a buffer nothing else refers to, measured on this interpreter (the count a call
#: adds differs between Python versions)
_IDLE_REFS = _refs([np.empty(1, np.uint8)], 0)


def _idle(i: int) -> bool:
    """Whether nothing but the pool refers to ``_kept[i]`` (the caller holds the lock)."""
    return _refs(_kept, i) == _IDLE_REFS


#: an interpreter without the GIL counts references per thread, lazily: no pool there
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


def _after_fork_in_child() -> None:
    """A forked child starts with a new lock (another thread may have held the parent's at the fork) and keeps
    nothing: the parent's batches are the parent's."""
    global _lock
    _lock = threading.Lock()
    _kept.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _enabled() -> bool:
    return _GIL and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def byte_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` bytes: an idle kept one of that size when there is one, else a new one
    (kept when its size is pooled). Its contents are undefined, as ``np.empty``'s.

    Args:
        nbytes: the size in bytes.
    Returns:
        A one-dimensional ``uint8`` array that owns its memory.
    Cost: O(1) below :data:`MIN_BYTES` (``np.empty``); above, one lock and O(:data:`KEEP`) reference counts.
    """
    if nbytes < MIN_BYTES or nbytes > MAX_BYTES or not _enabled():
        return np.empty(nbytes, np.uint8)
    with _lock:
        for i in range(len(_kept)):
            if _kept[i].nbytes == nbytes and _idle(i):
                buf = _kept.pop(i)
                _kept.append(buf)  # the most recently used last
                return buf
        fresh = np.empty(nbytes, np.uint8)
        _kept.append(fresh)
        while len(_kept) > KEEP:
            del _kept[0]  # (one in use stays with its holders; the pool just no longer reuses it)
        return fresh


def release() -> int:
    """Let go of the kept buffers that nothing else refers to (their memory returns to the system), and stop
    tracking the others.

    Returns:
        The bytes of the idle buffers released.
    Cost: O(:data:`KEEP`); local.
    """
    with _lock:
        idle = sum(_kept[i].nbytes for i in range(len(_kept)) if _idle(i))
        _kept.clear()
        return idle


def kept_bytes() -> tuple[int, int]:
    """``(bytes kept, of which idle)``: what the pool holds now. O(:data:`KEEP`); local."""
    with _lock:
        total = sum(buf.nbytes for buf in _kept)
        idle = sum(_kept[i].nbytes for i in range(len(_kept)) if _idle(i))
        return total, idle

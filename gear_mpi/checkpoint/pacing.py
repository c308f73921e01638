"""Keeping a background checkpoint's writer out of the training loop's way: a byte budget and a low priority.

A background checkpoint (:mod:`~gear_mpi.checkpoint.background`) writes from a thread of its own while the
training thread samples. Three things decide how much the loop notices:

- **CPU.** Hashing (sha256) and copying take a core for as long as they run; on a node with no core to
  spare the writer's bursts take it from a rank, and every collective waits for the slowest rank.
  :func:`lower_priority` makes the writer thread nice 19 or ``SCHED_IDLE`` (Linux; it runs when a core
  would otherwise idle: while ranks wait for each other, for the GPU, for I/O), for that thread only.
- **The GIL.** Every time the writer takes the GIL back (after a call that released it) it may make the
  training thread wait, and a thread of low priority preempted while holding it makes it wait long. So
  the writer makes few, large calls: :data:`CHUNK` bytes hashed, copied or written per call.
- **Bursts.** :class:`Pacer` spreads the work over time: the writer hands files their data in chunks and
  sleeps between them, so that it uses at most ``cpu_share`` of a core (and moves at most ``rate`` bytes a
  second, if given) -- the checkpoint takes longer, and the device's writes come in a trickle.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Iterable, Iterator

import numpy as np

CHUNK = 8 << 20  # bytes handed over at a time: a few ms of hashing, one GIL handover per call (files.write_file_direct)


def _number(name: str, v, low: float, high: float | None = None) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not v > low \
            or (high is not None and not v <= high):
        bound = f"> {low:g}" + ("" if high is None else f" and <= {high:g}")
        raise ValueError(f"{name} must be a number {bound}, or None; got {v!r}")
    return float(v)


class Pacer:
    """The budget of one writer thread: at most ``rate`` bytes a second and ``cpu_share`` of a core.

    :meth:`chunks` cuts buffers into pieces of :data:`CHUNK` bytes. After each piece is consumed the thread
    sleeps (the GIL free): long enough that the CPU time it used since the first piece (``time.thread_time``:
    hashing, copying into the page cache, the file system's own work in this thread) stays within
    ``cpu_share`` of the time since, and that the bytes stay within ``rate``. Even unbudgeted, it sleeps
    a moment between pieces, so the thread never holds a core for a whole scheduler tick.

    Args:
        rate: bytes per second (> 0), or None for no byte limit.
        cpu_share: the fraction of one core (> 0, <= 1), or None for no CPU limit.
    Raises:
        ValueError: ``rate`` or ``cpu_share`` is out of range (named).
    """

    def __init__(self, rate: float | None = None, cpu_share: float | None = None):
        self.rate = _number("write_rate", rate, 0.0)
        self.cpu_share = _number("cpu_share", cpu_share, 0.0, 1.0)
        self.moved = 0        # bytes handed over
        self.slept = 0.0      # seconds slept to keep to the budget
        self.hurry = False    # set by a thread that waits for this one: no more sleeps, the priority back
        self._hurried = False
        self._t0: float | None = None
        self._cpu0 = 0.0

    def wait(self, nbytes: int) -> None:
        """Account for ``nbytes`` about to be moved, sleeping first as long as the budget needs. O(1)."""
        if self.hurry and not self._hurried:
            self._hurried = True
            restore_priority(threading.get_native_id())
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._cpu0 = now, time.thread_time()
        due = now
        if self.rate is not None:
            due = max(due, self._t0 + self.moved / self.rate)
        if self.cpu_share is not None:
            due = max(due, self._t0 + (time.thread_time() - self._cpu0) / self.cpu_share)
        if self.moved and not self.hurry:  # between pieces: at least a moment off the core
            pause = max(due - now, 1e-5)
            time.sleep(pause)
            self.slept += pause
        self.moved += int(nbytes)

    def chunks(self, buffers: Iterable) -> Iterator[memoryview]:
        """The bytes of ``buffers`` (bytes-like, numpy arrays included) in order, as views of at most
        :data:`CHUNK` bytes, each handed over within the budget. No copy."""
        for buf in buffers:
            mv = memoryview(buf).cast("B")
            for a in range(0, len(mv), CHUNK):
                piece = mv[a:a + CHUNK]
                self.wait(len(piece))
                yield piece


def restore_priority(tid: int) -> bool:
    """Give thread ``tid`` (a native id: the calling thread's own) the normal policy and nice 0 back, where
    this process may (root, or ``RLIMIT_NICE``). Best effort, O(1); never raises.

    Returns:
        Whether it was done.
    """
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, 0)
        return True
    except (AttributeError, OSError):
        return False


def lower_priority(idle: bool = True) -> str:
    """Lower the calling thread's CPU priority (not the process's): ``SCHED_IDLE`` where the system allows
    it and ``idle`` is true, else nice 19. Local, O(1); never raises.

    Nice 19 still gets a slice within the scheduler's period whenever it is runnable; ``SCHED_IDLE`` runs
    only on a core nothing else wants, and may wait far longer -- also while it holds the GIL, which the
    training thread then waits for.

    Args:
        idle: try ``SCHED_IDLE`` first.
    Returns:
        What was done: ``"idle"``, ``"nice"`` or ``"none"`` (not supported here).
    """
    if idle:
        try:  # Linux: pid 0 is the calling thread
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except (AttributeError, OSError):
            pass
    try:  # Linux: a thread id names that thread alone
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(19, os.getpriority(os.PRIO_PROCESS, tid)))
        return "nice"
    except (AttributeError, OSError):
        return "none"

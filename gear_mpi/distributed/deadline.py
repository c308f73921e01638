"""Waiting with a deadline, and the communicators a timed-out collective left unusable.

:func:`poll` is the loop every deadline-bound wait of the package runs: it tests a
request, yielding the core at first and then sleeping up to 1 ms between tests
(ranks often outnumber cores). A collective that times out stays pending on its
communicator, and a later collective there could be matched against it; so
:func:`mark_pending` records the communicator, and every
:class:`~gear_mpi.distributed.comm.MpiComm` later built on it (a ``Replay.load``, a new
``Replay``) starts out unusable with that cause (:func:`pending_reason`) and
raises at once instead of waiting out another deadline. The pending request itself is kept
(:func:`keep_pending`): mpi4py holds a request's buffers until it completes, so a late rank's data that MPI
still delivers lands in memory nobody else was given since (a new batch, ``gear_mpi.batch_memory``).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

_PENDING: dict[int, str] = {}
_KEPT_REQUESTS: list = []  # requests of collectives that timed out or were interrupted, never completed here


def poll(test: Callable[[], bool], seconds: float) -> bool:
    """Call ``test()`` until it returns True or ``seconds`` pass. Local.

    Args:
        test: e.g. an mpi4py request's ``Test``; an exception it raises propagates.
        seconds: the most to wait, counted from this call.
    Returns:
        True when ``test()`` returned True in time, False when the time ran out.
    Cost: the polls, each followed by ``sched_yield`` for the first 20 ms, then by
    a sleep of at most 1 ms (1 % of the time waited so far).
    """
    if test():
        return True
    start = time.monotonic()
    deadline = start + seconds
    while not test():
        now = time.monotonic()
        if now - start < 0.02:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, (now - start) * 0.01))
        if now > deadline:
            return False
    return True


def _key(comm: Any) -> int | None:
    try:
        return int(comm.py2f())
    except Exception:
        return None


def mark_pending(comm: Any, reason: str) -> None:
    """Record that a collective timed out on ``comm`` and is still pending there. Local, O(1).

    Args:
        comm: the mpi4py communicator.
        reason: the timeout's message (said again by every later use).
    """
    key = _key(comm)
    if key is not None:
        _PENDING[key] = reason


def keep_pending(req: Any) -> None:
    """Keep ``req``, a request left pending by a timeout or an interrupt, and with it the buffers mpi4py holds
    for it, for the rest of the process: MPI may still write into them when a late rank arrives, so they must
    not be freed and handed out again. At most one set a communicator (it is unusable afterwards). Local, O(1)."""
    _KEPT_REQUESTS.append(req)


def pending_reason(comm: Any) -> str | None:
    """Returns why ``comm`` is unusable (a timed-out collective is pending there), or None. Local, O(1).

    Args:
        comm: the mpi4py communicator.
    """
    key = _key(comm)
    return None if key is None else _PENDING.get(key)


def forget(comm: Any) -> None:
    """Drop ``comm`` from the record (before it is freed: its handle may be reused). Local, O(1).

    Args:
        comm: the mpi4py communicator.
    """
    key = _key(comm)
    if key is not None:
        _PENDING.pop(key, None)


def finish(req: Any, seconds: float, size: int, mpi_error: type) -> str | None:
    """Poll ``req`` (:func:`poll`) until it completes or ``seconds`` pass. Local.

    Args:
        req: an mpi4py request of a collective (anything with ``Test()``).
        seconds: the most to wait.
        size: the communicator's size (for the message).
        mpi_error: mpi4py's ``MPI.Exception``.
    Returns:
        None when it completed; else why not: the time ran out, or MPI failed the request because the
        ranks are out of step. A rank whose collective timed out leaves it pending, and the next one
        posted there (by it or by its peers) may be matched with it: Open MPI then fails the request
        (e.g. ``MPI_ERR_TRUNCATE``) where MPICH lets it time out. Under ULFM (Open MPI's
        ``mpiexec --with-ft ulfm``) MPI fails it at once with ``MPI_ERR_PROC_FAILED`` when a rank died.
    """
    try:
        if poll(req.Test, seconds):  # it tests first: one Test, not two, when the request is already done
            return None
    except mpi_error as e:
        if _process_failed(e):
            return f"not every rank of {size} arrived: MPI reports that a rank of the job failed ({e})"
        return (f"not every rank of {size} arrived: MPI failed the collective ({e}), as when a rank left "
                f"an earlier collective pending after a timeout and this one met it")
    return f"not every rank of {size} arrived within timeout={seconds:g} s"


def _process_failed(e: Any) -> bool:
    """Whether mpi4py's exception ``e`` is ULFM's ``MPI_ERR_PROC_FAILED`` (an MPI without ULFM gives
    the constant ``MPI_ERR_UNKNOWN``'s value: never taken for it)."""
    MPI = sys.modules.get(type(e).__module__)
    failed = {getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING")}
    try:
        return e.Get_error_class() in failed - {None, getattr(MPI, "ERR_UNKNOWN", None)}
    except Exception:
        return False


class AllOf:
    """Several mpi4py requests seen as one: ``Test`` is true when all are complete.

    Args:
        MPI: the mpi4py ``MPI`` module.
        requests: the requests.
    """

    def __init__(self, MPI: Any, requests: list):
        self.MPI, self.requests = MPI, requests

    def Test(self) -> bool:
        """Returns True when every request is complete (one ``MPI.Request.Testall``). Local."""
        return bool(self.MPI.Request.Testall(self.requests))

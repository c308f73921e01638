"""Prefetching batches: the next samples' selection and exchange run while the training step runs.

``replay.batches(batch_size, ...)`` returns a :class:`BatchIterator`. A background
thread of each rank runs the replay's samples (a collective: every rank's thread calls
them in the same order) and hands the batches over through a queue; the training loop
takes them with ``next()``. While it iterates, the replay belongs to that thread: the
training loop gives priority updates through the iterator
(:meth:`BatchIterator.update_priorities`), and any other call of the replay from another
thread (a sample, an update, an insert, stats...) raises RuntimeError.

The schedule is the same on every rank, whatever the timing, so the collectives match:

- sample ``j`` (1-based) starts only once the loop has taken batch ``j - prefetch``:
  at most ``prefetch`` batches wait ready;
- an update given after the loop took batch ``k`` is applied (a collective) after sample
  ``k + prefetch`` and before sample ``k + prefetch + 1``, the first one that cannot have
  started yet: as soon as the thread is free, so while the step runs rather than in front
  of that sample. So at most ``prefetch`` batches are sampled before an update is applied
  (the *staleness*); ``prefetch=0`` samples each batch when asked for it, after every
  earlier update;
- :meth:`BatchIterator.close` (also on leaving a ``with`` block, on an exception in the
  loop, and at ``replay.close()``) lets the thread finish the samples that are already
  allowed -- up to ``prefetch`` more, the same count on every rank -- applies the updates
  still pending, and joins it. Nothing is left behind: no thread, request or segment.

If one rank stops iterating while the others go on, the others' next collective fails
with CollectiveTimeoutError after the replay's ``timeout`` (raised by their ``next()``),
never hangs. An error of a sample (e.g. EmptyReplayError, agreed on every rank) is
raised by the ``next()`` that would have returned that batch. Ranks whose threads are in
different calls (one rank gave an update the others did not: its thread applies it while
theirs sample) all raise the same CollectiveError naming both calls
(:mod:`gear_mpi.distributed.calls`): the thread's calls are numbered with the replay's
others, since the replay is the thread's alone while it runs.

MPI: the thread makes MPI calls while the main thread may make its own, so the MPI
library must provide ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default; checked).
Cost: one thread per iterator, ``prefetch`` batches of memory, no extra communication; less, in
fact: up to 64 ranks the thread's updates take one rendezvous instead of four (the call's head, and an
allgather in flight with it that carries the per-owner counts and, when each rank gives no more keys than
in the previous update, the keys themselves: :func:`gear_mpi.distributed.routing.route_deferred`; each
owner counts what it applied:
``iterator.applied``).
Every collective is a rendezvous of the ranks' threads, and each waits there for any other whose
training thread or another process took its core (on 2 ranks x 1 core this, not the thread's own
work, made its sample + update 10-25 % slower than the same work in the training thread).
The thread refills a ring of ``prefetch + 2`` batches (``sample(out=...)``) instead of
allocating new ones: fresh batches cost the thread page faults (tens per 2 MB batch, as freed
memory goes back to the system): on 2 ranks x 1 core, prefetch=2, a step costing one sample
hid 86-92 % of the replay's time with a ring and 69 % without (scripts/bench/bench_prefetch.py).
``recycle`` says when a batch of the ring is refilled, once the loop has taken two more:

- ``"auto"`` (the default): only when nothing outside the iterator still references it or
  any of its tensors, buffers or views (:meth:`~gear_mpi.batch.Batch.references`); a batch the
  loop kept (a list of batches, a tensor saved in an autograd graph still alive, a view) is
  left alone and a new one takes its place in the ring. Safe, and as fast as ``True`` in a
  loop that drops its batches;
- ``True``: always, even if the loop kept it (the loop must copy what it keeps);
- ``False``: never: a new batch every step.
``iterator.sample_seconds`` (the thread's time in samples and updates) and
``iterator.wait_seconds`` (the loop's time blocked in ``next()``) show how much was hidden.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any

from .. import errors
from ..spec import check_count

_STOP = object()


def check_thread_level() -> None:
    """Raise unless MPI was initialised with ``MPI_THREAD_MULTIPLE``.

    Raises:
        RuntimeError: a lower thread level, naming it and the fix.
    """
    from mpi4py import MPI
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "THREAD_SINGLE", MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED"}
        raise RuntimeError(f"replay.batches() samples on a background thread and needs MPI_THREAD_MULTIPLE; MPI "
                           f"was initialised with {names.get(level, level)}: leave mpi4py.rc.thread_level at its "
                           f"default 'multiple' (set before `from mpi4py import MPI`), or use an MPI library that "
                           f"provides it")


def _numba_threads(n: int | None = None) -> int | None:
    """The calling thread's numba thread count (None without numba), after setting it to ``n`` if given."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency
        return None
    if n is not None:
        numba.set_num_threads(n)
    return numba.get_num_threads()


_RECYCLE = {False: 0, True: 1, "auto": 2}
MAX_PREFETCH = 1 << 16  #: batches sampled ahead at most (each holds a batch's memory)
_RECYCLE_NAMES = ["False", "True", "'auto'"]


def _check_arguments(replay, prefetch, limit, recycle) -> None:
    """This rank's checks of :class:`BatchIterator`'s arguments (local, O(1); raises as its docstring says)."""
    check_count(prefetch, "prefetch", 0, most=MAX_PREFETCH)
    check_count(limit, "limit", 0, optional=True)
    if recycle not in (True, False, "auto") or not isinstance(recycle, (bool, str)):
        raise ValueError(f"recycle must be 'auto', True or False, got {recycle!r}")
    if recycle is True and getattr(replay, "device", None) is not None:
        raise ValueError("recycle=True refills host batches (sample's out=): a device replay returns new ones")


class BatchIterator:
    """Batches sampled ahead by a background thread (see the module docstring).

    Args:
        replay: the :class:`~gear_mpi.replay.Replay` whose ``sample`` and deferred updates the thread calls.
        owner: the replay's :class:`ReplayPrefetch`, which this iterator claims while it runs.
        batch_size, window, align, mode: as :meth:`Replay.sample` (the same for every batch).
        prefetch: batches sampled ahead (0 to ``MAX_PREFETCH``).
        limit: stop after this many batches (None: never; ``next()`` then raises StopIteration on every rank).
        recycle: ``"auto"``, True or False: when to refill the batches of a ring of ``prefetch + 2`` instead of
            allocating new ones (host replays; see the module docstring).
    Raises:
        ValueError: a bad ``prefetch``, ``limit`` or ``recycle``, ``recycle=True`` on a device replay, or ranks
            passing different ones, on every rank (a ``"batches"`` head agrees them: one small allgather, or a row
            on the node board); RuntimeError: MPI without THREAD_MULTIPLE.
    """

    __reduce_ex__ = errors.not_copyable("a batches() iterator (it runs a thread over the replay)",
                                        "take its batches (copy.deepcopy(batch) copies one) and close it")

    def __init__(self, replay, owner: "ReplayPrefetch", batch_size: int, window: int | None, align: str,
                 mode: str | None, prefetch: int, limit: int | None, recycle: bool | str = "auto"):
        if replay.comm.size > 1:  # a property of the job, the same on every rank: raised there too, unagreed
            check_thread_level()
        err = None
        try:
            _check_arguments(replay, prefetch, limit, recycle)
        except Exception as e:  # agreed below: raised on every rank
            err, prefetch, limit, recycle = e, 0, None, False
        # a "batches" head: a bad argument on one rank raises on every rank, and the schedule's arguments
        # (prefetch, limit, recycle) must be the same everywhere, else the threads would sample apart
        agreed = replay.calls.agree(err, "batches", [prefetch, -1 if limit is None else limit, _RECYCLE[recycle]])
        if (agreed != agreed[0]).any():
            raise ValueError(f"batches: prefetch, limit and recycle must be the same on every rank; got prefetch "
                             f"{agreed[:, 0].astype(int).tolist()}, limit {agreed[:, 1].astype(int).tolist()} (-1: "
                             f"None) and recycle {[_RECYCLE_NAMES[int(v)] for v in agreed[:, 2]]}")
        if recycle == "auto" and getattr(replay, "device", None) is not None:
            recycle = False  # device batches are new ones
        self.replay, self.owner, self.prefetch, self.limit = replay, owner, int(prefetch), limit
        self._args = (batch_size, window, align, mode)
        self._ring: list | None = [None] * (self.prefetch + 2) if recycle else None
        self._checked = recycle == "auto"  # refill only batches nobody else references
        self._ring_refs: list = [None] * (self.prefetch + 2)  # each ring batch's references() when handed over
        self.recycled = 0  # batches refilled from the ring (this rank)
        self._cv = threading.Condition()
        self._ready: collections.deque = collections.deque()  # (j, batch or exception)
        self._updates: dict[int, list] = collections.defaultdict(list)  # before sample j: [(keys, priorities)]
        self._taken = 0  # batches the loop has taken
        self._given = None  # the host batch next() returned last
        self._closing = False
        self._finished = threading.Event()  # the thread's last act (a join interrupted may mark it ended early)
        self._released = False  # close() joined the thread and gave the replay back
        self._error: BaseException | None = None
        self.applied = 0  # priorities this rank's shard applied for the deferred updates (any rank's keys)
        self.sample_seconds = 0.0  # the thread's time in samples and updates (this rank)
        self.wait_seconds = 0.0  # the training loop's time blocked in next() (this rank)
        self._numba_threads = _numba_threads()
        self._thread = threading.Thread(target=self._run, name="gear_mpi-prefetch", daemon=True)
        owner.claim(self)
        self._thread.start()

    # ---- the background thread ----------------------------------------------------------
    def _last_allowed(self) -> int:
        """The last sample that may start now (the same rule on every rank)."""
        last = self._taken + self.prefetch
        if self.limit is not None:
            last = min(last, self.limit)
        return last

    def _run(self) -> None:
        replay, j = self.replay, 0
        _numba_threads(self._numba_threads)  # numba's thread count is per thread: the caller's share
        try:
            while True:
                with self._cv:  # wait until sample j + 1 may start, or an update due before it arrives
                    while j + 1 > self._last_allowed() and not self._updates.get(j + 1) and not self._closing:
                        self._cv.wait()
                    updates = self._updates.pop(j + 1, [])
                    sample = j + 1 <= self._last_allowed()
                    if not sample and not updates:  # closing, and every allowed sample is done
                        break
                t0 = time.perf_counter()
                # updates due before sample j + 1 go now, while the step runs: same order on every rank
                # (after sample j, before sample j + 1), and the sample no longer waits for them
                for keys, priorities in updates:
                    self.applied += replay._update(keys, priorities, deferred=True)
                if sample:
                    j += 1
                    try:
                        item = replay.sample(*self._args[:3], mode=self._args[3], out=self._out(j))
                    except BaseException as e:  # raised by the next() that would have returned this batch
                        item = e
                self.sample_seconds += time.perf_counter() - t0
                if not sample:
                    continue
                if self._ring is not None and not isinstance(item, BaseException):
                    self._ring[j % len(self._ring)] = item
                    if self._checked:  # the same holders as in _out: the ring and one local name
                        self._ring_refs[j % len(self._ring)] = item.references()
                with self._cv:
                    self._ready.append((j, item))
                    self._cv.notify_all()
                if isinstance(item, BaseException):
                    return
            # updates given after the last sample was allowed: applied now, in order, on every rank
            with self._cv:
                rest = [u for k in sorted(self._updates) for u in self._updates[k]]
                self._updates.clear()
            for keys, priorities in rest:
                self.applied += replay._update(keys, priorities, deferred=True)
        except BaseException as e:
            with self._cv:
                self._error = e
                self._cv.notify_all()
        finally:
            self._finished.set()

    def _out(self, j: int):
        """The batch sample ``j`` refills (``recycle``): sample ``j - prefetch - 2``'s, which the loop has
        left two next() calls ago; None while the ring fills, without ``recycle``, or (``"auto"``) when
        something outside still references that batch (it then leaves the ring)."""
        if self._ring is None:
            return None
        i = j % len(self._ring)
        batch = self._ring[i]
        if batch is None:
            return None
        if self._checked:
            refs = batch.references()
            if refs is None or refs != self._ring_refs[i]:
                self._ring[i] = None
                return None
        self.recycled += 1
        return batch

    # ---- the training loop's side ---------------------------------------------------------
    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self):
        """The next batch (waits while it is being sampled).

        Raises:
            StopIteration: ``limit`` batches were taken, or the iterator is closed.
            The sample's error (EmptyReplayError, CollectiveTimeoutError, ...) at the batch it would have been.
        """
        with self._cv:
            if self._closing or (self.limit is not None and self._taken >= self.limit):
                raise StopIteration
            self._taken += 1  # sample taken + prefetch may start now
            self._cv.notify_all()
            if not self._ready and self._error is None:
                t0 = time.perf_counter()
                while not self._ready and self._error is None:
                    self._cv.wait()
                self.wait_seconds += time.perf_counter() - t0
            if not self._ready:
                raise self._error
            j, item = self._ready.popleft()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._given = item if item._np is not None else None  # a host batch: update_priorities reads its keys
        return item

    def update_priorities(self, keys: Any, priorities: Any) -> None:
        """Collective (deferred): set priorities, applied by the thread before sample ``taken + prefetch + 1``.

        Every rank must call it the same number of times between the same batches (as ``Replay.update_priorities``).
        Args:
            keys, priorities: as :meth:`Replay.update_priorities` (copied now).
        Raises:
            RuntimeError: the iterator is closed.
        """
        import numpy as np
        # copied before taking the lock, and the keys of the batch just given from its numpy buffer: torch
        # calls right after the step cost the training thread tens of microseconds of cold code each
        last = self._given
        try:
            if last is not None and last.owns_keys(keys):
                k = last._meta_np[0].copy()
            else:
                k = np.array(keys.numpy() if hasattr(keys, "numpy") else keys, copy=True)
            if type(priorities) is np.ndarray:
                p = priorities.copy()
            else:
                p = np.array(priorities.detach().cpu().numpy() if hasattr(priorities, "detach") else priorities,
                             copy=True)
        except (TypeError, ValueError, RuntimeError):  # (ragged lists, a tensor numpy cannot take): given as they
            k, p = keys, priorities  # are, so that the thread's update, agreed, refuses them on every rank in step
        with self._cv:
            if self._closing:
                raise RuntimeError("update_priorities: this batches() iterator is closed")
            self._updates[self._taken + self.prefetch + 1].append((k, p))

    def close(self) -> None:
        """Finish the samples already allowed and the pending updates, then join the thread (collective in
        effect: every rank's thread runs the same remaining collectives). Idempotent.

        Raises:
            GearError: the thread's error, if it failed outside a sample (e.g. a timed-out update's
                CollectiveTimeoutError), raised again here; CollectiveError: a sample the loop did not take
                failed as a collective (another rank stopped iterating sooner: a timeout), as ``next()``
                would have raised it. Other errors of samples not taken (EmptyReplayError) are dropped. A KeyboardInterrupt while it waits for the thread
                leaves the iterator active: the next ``close()`` (``replay.close()``'s) waits again.
        """
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._released:
            return
        # the thread's own event, not Thread.join alone: CPython 3.11 marks a thread ended when a signal
        # interrupts a join, and a second join then returns at once while it still samples
        self._finished.wait()
        self._thread.join()
        self._released = True
        if self._error is None:  # a sample the loop never took failed as a collective (a rank stopped earlier
            # than this one: its thread's next sample timed out): the replay is unusable now, so say so here
            self._error = next((item for _, item in self._ready if isinstance(item, errors.CollectiveError)), None)
        self._ready.clear()
        self._ring = self._given = None
        self.owner.release(self)
        if self._error is not None:
            raise self._error

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closing

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closing", True) and getattr(self, "_thread", None) is not None:
            try:
                self.close()
            except Exception:
                pass


class ReplayPrefetch:
    """The part of a :class:`~gear_mpi.replay.Replay` that knows which :class:`BatchIterator`, if any, owns the
    replay while it runs (at most one). Local; every method is O(1).
    """

    def __init__(self):
        self.iterator: BatchIterator | None = None  # the active batches() iterator

    def start(self, replay, batch_size: int, window: int | None, align: str, mode: str | None, prefetch: int,
              limit: int | None, recycle: bool | str) -> BatchIterator:
        """A new :class:`BatchIterator` of ``replay`` (its arguments), which owns the replay until it closes.

        Raises:
            RuntimeError: an iterator is already active; as :class:`BatchIterator`.
        """
        if self.iterator is not None:
            raise RuntimeError("this replay already has an active batches() iterator: close it first")
        return BatchIterator(replay, self, batch_size, window, align, mode, prefetch, limit, recycle)

    def claim(self, iterator: BatchIterator) -> None:
        """``iterator`` owns the replay from now on (called by the iterator before its thread starts)."""
        self.iterator = iterator

    def release(self, iterator: BatchIterator) -> None:
        """``iterator`` no longer owns the replay (called by the iterator once its thread has joined)."""
        if self.iterator is iterator:
            self.iterator = None

    def check_owner(self) -> None:
        """Raise unless no iterator is active or the caller is the active iterator's thread.

        Raises:
            RuntimeError: a batches() iterator owns the replay and this is another thread.
        """
        if self.iterator is not None and threading.current_thread() is not self.iterator._thread:
            raise RuntimeError("a batches() iterator owns this replay while it runs: give priority updates "
                               "with iterator.update_priorities(), and close the iterator before other calls")

    def close(self) -> BaseException | None:
        """Close the active iterator, if any (as :meth:`BatchIterator.close`: collective in effect).

        Returns:
            The error its close raised (its thread's), for ``Replay.close`` to raise once the rank is closed.
        Raises:
            An interrupt (KeyboardInterrupt) while its thread still runs: the iterator stays active, and the
            next call waits for the thread again (the replay must not close its shard under it).
        """
        if self.iterator is None:
            return None
        try:
            self.iterator.close()
        except BaseException as e:
            if self.iterator is not None:
                raise
            return e
        return None

"""Writers: actor processes stream steps and episodes into a rank's shard.

``Writer(replay.writer_address())`` works in any process of the rank's node -- spawned
by the rank or started on its own, not an MPI rank, with no mpi4py initialised. It
stages into a shared-memory ring of its own (:mod:`gear_mpi.feeds.staging`); the owning
rank moves ended episodes into its shard at its next ``sample``,
``update_priorities`` or ``stats``, or at ``replay.ingest()``. :class:`EpisodeWriter`
is the interface every writer shares (also :class:`gear_mpi.feeds.remote.MpiWriter`, for
actor ranks on other nodes): steps are validated here, in the actor, with the errors
of ``Replay.insert``.

Semantics (documented choices):

- An episode becomes visible only when ended; ``close()`` (and a killed process)
  drops an open episode and nothing else.
- A writer belongs to the process that made it: in a child forked from that process its
  copy is closed (its calls raise WriterError naming the process; its ``close()`` does
  nothing), so the parent's writer goes on undisturbed. Each process makes its own.
- An episode may hold at most ``spec.max_length`` steps: the ``append`` that would
  exceed it raises InvalidTrajectoryError and appends nothing (end the episode, or
  split it yourself); no silent splitting.
- When the staging ring is full the writer waits (backpressure: the owner drains only
  what the replay's rate limiter allows) and raises WriterTimeoutError after
  ``timeout`` seconds; when the replay is closed or its owner died it raises
  WriterError, within ``timeout`` at the latest, never hanging.
- With a rate limiter, the owner also caps how many ended episodes each writer may
  have staged and not yet ingested (its share of the rank's insert allowance plus a
  slack of one band; :mod:`gear_mpi.feeds.replay_feeds`): ``end_episode``/``insert``
  wait (the *hold*) while the writer has that many, so an actor runs only as fast as
  the limiter lets its episodes in and its data stays fresh. The hold lasts as long as
  the owner runs (a learner that stops sampling legitimately holds its actors), or
  ``hold_timeout`` seconds, then WriterTimeoutError with the episode still open. A
  closed replay or dead owner ends it with WriterError, as above.
"""
from __future__ import annotations

import math
import os
import time
import weakref
from typing import Any, Mapping

import numpy as np

_ndarray, _generic = np.ndarray, np.generic

from ..distributed.comm import check_timeout
from ..distributed.deadline import poll
from ..errors import InvalidPriorityError, InvalidTrajectoryError, WriterError, WriterTimeoutError, not_copyable
from ..kernels.hints import publish
from ..spec import TrajectorySpec, _castable, check_finite_columns, whole_number
from .staging import (R_CLOSED, R_HOLD, S_CLOSED, S_CONSUMED, S_CONSUMED_STEPS, S_PUBLISHED, S_PUBLISHED_STEPS,
                      Registry, Staging)

_STAGING_BYTES = 64 << 20  # default staging area: about 64 MiB of steps (at least 2 episodes)
_OWNER_CHECK_SECONDS = 0.1  # how often end_episode/insert look whether the owner still runs (at most timeout / 4)


def check_priority(priority: Any, where: str) -> float:
    """``priority`` as a finite, non-negative float.

    Raises:
        InvalidPriorityError: anything else.
    """
    try:
        if isinstance(priority, (str, bytes)):  # float() would parse them
            raise TypeError
        p = float(priority)
    except (TypeError, ValueError):
        raise InvalidPriorityError(f"{where}: priority must be a number, got {priority!r:.60}") from None
    if not (p >= 0.0 and math.isfinite(p)):
        raise InvalidPriorityError(f"{where}: priority is {p}: priorities must be finite and non-negative")
    return p + 0.0


class EpisodeWriter:
    """What every writer offers: ``append``/``end_episode``/``insert``/``close``, and a context manager.

    Subclasses say where steps go (:meth:`_setup` with the column arrays, :meth:`_room`, :meth:`_rows`,
    :meth:`_publish`) and keep ``_base`` (the row of the open episode's first step) current.
    Attributes:
        spec: the replay's :class:`~gear_mpi.spec.TrajectorySpec`.
    """

    spec: TrajectorySpec

    def _setup(self, spec: TrajectorySpec, columns: Mapping[str, np.ndarray], check_finite: bool = False) -> None:
        """``columns``: column name -> the array whose rows receive the steps (a ring of ``len`` rows);
        ``check_finite``: refuse NaN and inf step values (in ``append`` and ``insert``)."""
        self.spec = spec
        self._targets = [(c.name, columns[c.name], c.dtype, c.shape) for c in spec.columns]
        self._finite = [(c.name, columns[c.name]) for c in spec.columns if c.dtype.kind in "fc"] if check_finite else ()
        self._period = len(columns[spec.columns[0].name])
        self._base = 0  # the row of the open episode's first step
        self._names = frozenset(spec.names)
        self._max_length = spec.max_length
        self._open_steps = 0  # steps of the open episode
        self._fits = 0  # open-episode steps known to fit without looking at the owner's counters
        self._episodes = 0  # episodes published by this writer
        self._closed = False
        self._why_closed = "this writer is closed"  # what a call on a closed writer says

    # ---- what subclasses provide ---------------------------------------------------------
    def _room(self, steps: int) -> None:
        """Wait until the open episode can hold ``steps`` steps (raise on timeout, or when the owner is gone);
        set ``_fits`` to how many it can hold now without waiting; raise WriterError when closed."""
        raise NotImplementedError

    def _rows(self, count: int) -> list[tuple[dict[str, np.ndarray], slice]]:
        """Where a whole trajectory of ``count`` steps goes (no episode open): (column views, rows) pieces."""
        raise NotImplementedError

    def _publish(self, length: int, priority: float) -> None:
        """Make the open episode of ``length`` steps one trajectory."""
        raise NotImplementedError

    # ---- the interface -------------------------------------------------------------------
    def append(self, step: Mapping[str, Any]) -> None:
        """Add one step to the open episode (local; O(columns), one copy of the step).

        Args:
            step: column name -> array of the column's per-step shape (no length axis).
        Raises:
            InvalidTrajectoryError: a column missing or unknown, a wrong shape or uncastable dtype, the
                episode would exceed ``max_length``, or (``check_finite``) a NaN or inf value (nothing is appended).
            WriterTimeoutError: no room in the staging area within ``timeout`` (backpressure).
            WriterError: the writer is closed, or its replay closed or owner died.
        """
        if type(step) is not dict and not isinstance(step, Mapping):
            raise InvalidTrajectoryError(f"append: expected a mapping of column -> array, got {type(step).__name__}")
        n = self._open_steps
        if n >= self._max_length:
            if self._closed:
                raise WriterError(f"append: {self._why_closed}")
            raise InvalidTrajectoryError(f"append: the episode would have {n + 1} steps, more than max_length="
                                         f"{self._max_length}; call end_episode() first")
        if n >= self._fits:
            self._room(n + 1)
        row = self._base + n
        if row >= self._period:
            row -= self._period
        # each column is checked, then written; a failed check leaves the row beyond the episode's end
        try:
            for name, target, dtype, shape in self._targets:
                v = step[name]
                if (type(v) is not _ndarray and not isinstance(v, _generic)) or v.dtype != dtype or v.shape != shape:
                    v = self._convert(name, v)
                target[row] = v
        except KeyError:
            raise InvalidTrajectoryError(f"append: missing column {name!r}; the spec has "
                                         f"{list(self.spec.names)}") from None
        if len(step) != len(self._targets):
            extra = [k for k in step if k not in self._names]
            raise InvalidTrajectoryError(f"append: unknown column(s) {extra}; the spec has {list(self.spec.names)}")
        if self._finite:
            self._check_finite_step(row, n)
        self._open_steps = n + 1

    def _check_finite_step(self, row: int, n: int) -> None:
        """``check_finite``: the step just written at ``row`` (step ``n`` of the open episode) holds no NaN or inf."""
        for name, target in self._finite:
            if not np.isfinite(target[row]).all():
                v = np.asarray(target[row]).reshape(-1)
                raise InvalidTrajectoryError(f"append: column {name!r} holds {v[~np.isfinite(v)][0]} at step {n} of "
                                             f"the open episode (check_finite=True refuses NaN and infinite values; "
                                             f"the step was not appended)")

    def _convert(self, name: str, v: Any) -> np.ndarray:
        """A step's column value checked and made an array (the slow path of :meth:`append`)."""
        c = self.spec[name]
        if hasattr(v, "detach") and hasattr(v, "cpu"):
            v = v.detach().cpu().numpy()
        v = np.asarray(v)
        if v.dtype != c.dtype and (v.dtype.kind not in "biufc" or not _castable(v.dtype, c.dtype)):
            raise InvalidTrajectoryError(f"append: column {name!r} has dtype {v.dtype}, which cannot be cast "
                                         f"safely to {c.dtype}")
        if v.shape != c.shape:
            raise InvalidTrajectoryError(f"append: column {name!r} has shape {v.shape}; expected one step "
                                         f"of shape {c.shape}")
        return v

    def end_episode(self, priority: float = 1.0) -> None:
        """The steps appended since the last end become one trajectory (local; O(1)).

        Args:
            priority: its priority (finite, >= 0).
        Raises:
            InvalidTrajectoryError: no step was appended since the last end.
            InvalidPriorityError: a bad priority (the episode stays open).
            WriterTimeoutError: as :meth:`append`, or held back by the rate limiter past ``hold_timeout``
                (the episode stays open: call ``end_episode`` again).
            WriterError: as :meth:`append`.
        """
        if self._closed:
            raise WriterError(f"end_episode: {self._why_closed}")
        p = check_priority(priority, "end_episode")
        if self._open_steps == 0:
            raise InvalidTrajectoryError("end_episode: no step was appended since the last end_episode()")
        self._publish(self._open_steps, p)
        self._open_steps = 0
        self._episodes += 1

    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0) -> None:
        """Add a whole trajectory (local; O(L) copy), as ``Replay.insert`` takes it.

        Args:
            trajectory: column name -> ``[L, *shape]`` array.
            priority: its priority (finite, >= 0).
        Raises:
            InvalidTrajectoryError: a bad trajectory (see ``TrajectorySpec.validate``), an episode is open, or
                (``check_finite``) a NaN or inf value, naming the column and step (nothing is staged).
            InvalidPriorityError: a bad priority.
            WriterTimeoutError, WriterError: as :meth:`end_episode` (nothing is added).
        """
        if self._closed:
            raise WriterError(f"insert: {self._why_closed}")
        if self._open_steps:
            raise InvalidTrajectoryError(f"insert: an episode of {self._open_steps} steps is open; call "
                                         f"end_episode() first")
        columns, length = self.spec.validate(trajectory, where="insert")
        if self._finite:
            check_finite_columns(columns, "insert")
        p = check_priority(priority, "insert")
        self._room(length)
        done = 0
        for cols, rows in self._rows(length):
            k = rows.stop - rows.start
            for name, data in columns.items():
                cols[name][rows] = data[done:done + k]
            done += k
        self._publish(length, p)
        self._episodes += 1

    @property
    def episodes(self) -> int:
        """Episodes this writer has ended or inserted."""
        return self._episodes

    def close(self) -> None:
        """Stop writing; an open episode is dropped. Idempotent."""
        self._closed = True
        self._max_length = 0  # append's length check raises WriterError from now on

    def __enter__(self) -> "EpisodeWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Writer(EpisodeWriter):
    """A writer into the shard of the rank whose :meth:`Replay.writer_address` is ``address`` (same node).

    Args:
        address: the string ``replay.writer_address()`` returned on the owning rank.
        timeout: seconds a full staging area may block a call before WriterTimeoutError.
        staging_steps: steps the staging ring holds (default: about 64 MiB worth, at least
            ``2 * max_length``); must be >= ``max_length``.
        check_finite: refuse NaN and infinite step values in ``append`` and ``insert``, here in the actor,
            before anything is published (off by default, as in numpy: then it costs nothing; on: one
            ``isfinite`` per float column and step).
        hold_timeout: seconds the rate limiter's hold may block ``end_episode``/``insert`` before
            WriterTimeoutError (None: as long as the owner runs and its replay is open).
    Raises:
        WriterError: no such ingest point (closed replay, another node), or all writer slots taken.
        MemoryBudgetError: ``/dev/shm`` too small for the staging area.
        ValueError: a bad ``timeout``, ``staging_steps`` or ``hold_timeout``.
    Attributes:
        held_seconds: seconds this writer has waited in the rate limiter's hold so far.
    Cost: one shared-memory segment of ``staging_steps * step_bytes`` (reserved at once) plus 32 bytes per
    staged episode; per step O(columns) Python and a copy; no system call on the fast path. Every
    ``end_episode``/``insert`` reads the clock and the owner's hold word, and at most every 0.1 s
    (``timeout / 4`` when shorter) looks whether the owner still runs, so a closed or dead owner (killed,
    exited without ``close()``, or a zombie) gives :class:`~gear_mpi.errors.WriterError` at the next episode
    end (or while held), within the timeout; the writer of a dead owner then removes its staging area and the
    owner's registry from ``/dev/shm``.
    """

    __reduce_ex__ = not_copyable("a Writer (it maps its rank's staging memory)", "pass replay.writer_address() "
                                 "to the other process and open gm.Writer(address) there")

    def __init__(self, address: str, *, timeout: float = 60.0, staging_steps: int | None = None,
                 check_finite: bool = False, hold_timeout: float | None = None):
        check_timeout(timeout)
        check_timeout(hold_timeout, "hold_timeout", optional=True)
        self.timeout = float(timeout)
        self.hold_timeout = None if hold_timeout is None else float(hold_timeout)
        self.held_seconds = 0.0
        self._registry = Registry.open(address)
        spec = self._registry.spec
        if staging_steps is None:
            staging_steps = max(2 * spec.max_length, min(1 << 20, _STAGING_BYTES // max(spec.step_bytes, 1)))
        if not whole_number(staging_steps, spec.max_length):
            self._registry.close()
            raise ValueError(f"staging_steps must be an integer >= max_length={spec.max_length}, got {staging_steps!r}")
        steps = int(staging_steps)
        try:
            self._stage = Staging.claim(self._registry, spec, steps, max(16, min(steps, 1 << 16)))
        except BaseException:
            self._registry.close()
            raise
        self._setup(spec, self._stage.columns, check_finite)
        self.address = address
        h = self._stage.header
        self._published = h[S_PUBLISHED:S_PUBLISHED + 1]
        self._published_steps = h[S_PUBLISHED_STEPS:S_PUBLISHED_STEPS + 1]
        self._consumed = h[S_CONSUMED:S_CONSUMED + 1]
        self._hold_word = self._registry.words[R_HOLD:R_HOLD + 1]
        self._written = 0  # steps written before the open episode (its first step's number)
        self._check_every = min(_OWNER_CHECK_SECONDS, self.timeout / 4)
        self._check_at = time.monotonic() + self._check_every
        self._pid = os.getpid()
        _LIVE.add(self)  # a forked child's copy is closed there (_forked)

    def _gone(self) -> None:
        why = self._registry.owner_gone()
        if why is not None:
            if not self._registry.words[R_CLOSED]:  # the owner died: nobody else will remove its segments
                self._stage.close(unlink=True)
                self._registry.unlink()
                self._registry.close()
                super().close()  # closed: close() has nothing left to do
            raise WriterError(f"writer of {self.address!r}: {why}; the open episode and anything not yet "
                              f"ingested are lost")

    def _room(self, steps: int) -> None:
        if self._closed:
            raise WriterError(self._why_closed)
        h, st = self._stage.header, self._stage
        need_steps = self._written + steps - st.steps
        need_records = self._episodes + 1 - st.episodes
        if h[S_CONSUMED_STEPS] >= need_steps and h[S_CONSUMED] >= need_records:
            self._fits = int(h[S_CONSUMED_STEPS]) + st.steps - self._written
            return

        def free() -> bool:
            if h[S_CONSUMED_STEPS] >= need_steps and h[S_CONSUMED] >= need_records:
                return True
            self._gone()
            return False
        if not poll(free, self.timeout):
            raise WriterTimeoutError(
                f"writer of {self.address!r}: no room in its staging area of {st.steps} steps for {self.timeout:g} s "
                f"(the owner rank has not ingested: it is not calling sample/update_priorities/stats/ingest, or its "
                f"rate limiter holds inserts back)")
        self._fits = int(h[S_CONSUMED_STEPS]) + st.steps - self._written

    def _hold(self) -> None:
        """Wait while this writer has as many ended episodes staged as the owner's hold word allows (the rate
        limiter's backpressure), polling the counters (at most 1 ms apart) and, every ``_check_every`` seconds,
        whether the owner still runs; ``hold_timeout`` bounds the wait.

        Raises:
            WriterTimeoutError: still held after ``hold_timeout``. WriterError: the owner is gone.
        """
        consumed, hold = self._consumed, self._hold_word

        def released() -> bool:
            cap = hold[0]
            if not cap or self._episodes - consumed[0] < cap:
                return True
            now = time.monotonic()
            if self._registry.words[R_CLOSED] or now >= self._check_at:
                self._check_at = now + self._check_every
                self._gone()
            return False
        start = time.monotonic()
        try:
            ok = poll(released, math.inf if self.hold_timeout is None else self.hold_timeout)
        finally:
            self.held_seconds += time.monotonic() - start
        if not ok:
            raise WriterTimeoutError(
                f"writer of {self.address!r}: held back by the replay's rate limiter for {self.hold_timeout:g} s "
                f"(hold_timeout): {self._episodes - int(consumed[0])} ended episodes of this writer wait to be "
                f"ingested and its owner lets each writer stage {int(hold[0])}; the learner samples too little "
                f"for its samples_per_insert, or not at all. Nothing was added (an open episode stays open)")

    @property
    def staged(self) -> int:
        """Episodes this writer has ended that its owner has not ingested yet (O(1), local)."""
        return self._episodes - int(self._consumed[0])

    def _rows(self, count: int) -> list[tuple[dict[str, np.ndarray], slice]]:
        s = self._stage.steps
        first = self._written % s
        head = min(count, s - first)
        pieces = [(self._stage.columns, slice(first, first + head))]
        if head < count:
            pieces.append((self._stage.columns, slice(0, count - head)))
        return pieces

    def _publish(self, length: int, priority: float) -> None:
        ns = time.monotonic_ns()
        now = ns * 1e-9
        if self._registry.words[R_CLOSED] or now >= self._check_at:  # a closed or dead owner is told now, not
            self._check_at = now + self._check_every                   # when the staging area fills
            self._gone()
        cap = self._hold_word[0]
        if cap and self._episodes - self._consumed[0] >= cap:
            self._hold()
        self._room(0)  # a free record
        rec = self._stage.records[self._episodes % self._stage.episodes]
        rec[0], rec[1], rec[3] = self._written, length, ns
        rec[2:3].view(np.float64)[0] = priority
        self._written += length
        self._base = self._written % self._period
        self._fits -= length
        self._published_steps[0] = self._written
        publish(self._published, self._episodes + 1)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the owner has ingested every ended episode (local).

        Args:
            timeout: seconds (None: the writer's timeout).
        Raises:
            WriterTimeoutError: not ingested in time; WriterError: the owner is gone, or this process forked from
                the writer's.
        """
        if self._pid != os.getpid():
            raise WriterError(f"flush: {self._why_closed}")
        h = self._stage.header

        def done() -> bool:
            if h[S_CONSUMED] >= self._episodes:
                return True
            self._gone()
            return False
        if not poll(done, self.timeout if timeout is None else timeout):
            raise WriterTimeoutError(f"flush: the owner of {self.address!r} ingested {int(h[S_CONSUMED])} of "
                                     f"{self._episodes} episodes in time")

    def _forked(self) -> None:
        """In a child forked from this writer's process: make this copy closed, never touching the shared
        staging area (the parent's writer goes on with it). O(1)."""
        if not self._closed:
            self._closed, self._max_length = True, 0  # append's length check raises WriterError from now on
            self._why_closed = (f"this writer belongs to process {self._pid}, which this one was forked from: a "
                                f"staging area has one producer; make a new gm.Writer(address) in this process")

    def close(self) -> None:
        """Stop writing (local): an open episode is dropped, ended ones are still ingested by the owner, which
        then removes the staging area (or this call does, when the owner is gone). Idempotent; in a process
        forked from the writer's it does nothing (the writer stays open in its own process)."""
        if self._closed:
            return
        super().close()
        publish(self._stage.header[S_CLOSED:S_CLOSED + 1], 1)
        owner_gone = self._registry.owner_gone() is not None
        self._stage.close(unlink=owner_gone)
        self._registry.close()

    def __repr__(self) -> str:
        return (f"Writer({self.address!r}, episodes={self._episodes}, open_steps={self._open_steps}, "
                f"staging_steps={self._stage.steps}, held_seconds={self.held_seconds:.3g})")


_LIVE: "weakref.WeakSet[Writer]" = weakref.WeakSet()  # this process's writers (closed in a forked child)


def _after_fork() -> None:
    """In a forked child: the parent's writers are the parent's (one producer per staging area; a child's
    ``close`` would end the parent's writer for the owner, which would then drop its later episodes)."""
    for w in list(_LIVE):
        w._forked()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

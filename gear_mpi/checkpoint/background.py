"""Checkpoints that do not stop the job: ``replay.checkpoint_every(directory, seconds, keep)``.

The schedule rides on the collectives the training loop already makes. Each rank's row of every
``sample``'s header (:mod:`gear_mpi.distributed.header`) carries a vote: 1 when ``seconds`` have
passed since this rank's last checkpoint began and its previous one is written (rank 0: installed),
else 0. When every rank votes 1 -- the agreed header is the same table on every rank, so every rank
decides alike -- each rank takes its snapshot right after that sample returns its batch
(:func:`~gear_mpi.checkpoint.incremental.snapshot`: changed segments and the table copied, unchanged
segments to be linked) and hands it to a thread of its own, which writes the files without MPI. Rank
0's thread then waits for every rank's ``done.json`` and writes the manifest (the checkpoint is complete
from that moment); rank 0's training thread deletes all but the newest ``keep`` when the next checkpoint
starts, or at ``wait`` (:mod:`~gear_mpi.checkpoint.series`). No collective is ever made from a thread, and no sample waits
for a file.

What a checkpoint holds: every shard as it was after the sample that started it (the same moment on
every rank: between two collectives), exactly as ``Replay.save`` would have written it then. A job
killed at any moment loses what was inserted after the newest complete checkpoint began; an
interrupted checkpoint is never read (no manifest).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from ..distributed.comm import differing_ranks
from ..errors import CheckpointError
from ..progress import human, log
from ..spec import check_count
from . import incremental, pacing, segment_file, series
from .arrival import assumed_rate
from .files import PARTED_VERSION, path_digest, rank_dir


class BackgroundCheckpoints:
    """The handle ``Replay.checkpoint_every`` returns; see the module docstring.

    Attributes:
        directory: the directory of checkpoints (``ckpt-NNNNNNNN`` inside).
        seconds: the interval (None: only :meth:`now` starts one). keep: complete checkpoints kept.
        started: checkpoints this handle began; completed: those it saw complete (rank 0 installs them;
            on the other ranks, those whose files this rank finished and every rank agreed on in
            :meth:`wait`); last: figures of this rank's last snapshot (bytes copied, linked, written in
            the loop, seconds the loop spent).
    """

    def __init__(self, replay, directory: str, seconds: float | None, keep: int, segment_bytes: int,
                 copy_limit: int, first: int, write_rate: float | None = None, cpu_share: float | None = None,
                 priority: str = "low"):
        self.replay = replay
        self.directory = directory
        self.seconds = seconds
        self.keep = keep
        self.copy_limit = copy_limit
        self.write_rate = write_rate
        self.cpu_share = cpu_share
        self.priority = priority
        self.k = segment_file.steps_per_segment(replay.spec, segment_bytes)
        self.changes = incremental.Changes(self.k, replay.shard.capacity_steps)
        self.seq = first                      # the next checkpoint's number (the same on every rank)
        self.started = 0
        self.completed = 0
        self.last: dict = {}
        self._base: incremental.Base | None = None
        self._snap: incremental.Snapshot | None = None  # the one being written: inserts copy before overwriting
        self._pacer: pacing.Pacer | None = None  # the writing thread's
        self._copies = incremental.table_blocks.Copies()  # the table's copies, reused (two, in turn)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lost = False  # this rank's files of its newest checkpoint will never come (rank 0 must not wait)
        self._clock = time.monotonic()
        self._prune = False  # rank 0: a checkpoint was installed since the last prune
        replay.shard.store.on_write = self._on_write

    def _on_write(self, first: int, steps: int) -> None:
        """``store.on_write``: note the segments an insert writes; protect those the thread still needs."""
        self.changes(first, steps)
        snap = self._snap
        if snap is not None:
            snap.protect(first, steps)

    # ---- the vote and the start (training thread) -------------------------------------------------
    def vote(self) -> float:
        """This rank's header value: 1.0 when a checkpoint is due and the previous one is written. O(1)."""
        if self.seconds is None or time.monotonic() - self._clock < self.seconds:
            return 0.0
        return 1.0 if self.idle else 0.0

    @property
    def idle(self) -> bool:
        """Whether no checkpoint of this rank is being written (rank 0: or installed). O(1)."""
        return self._thread is None or self._thread.ended.is_set()

    def after_sample(self, head: np.ndarray, column: int) -> None:
        """Start a checkpoint when every rank voted for it in the agreed header ``head``. Local."""
        if head.shape[0] and float(head[:, column].min()) >= 1.0:
            self._start()

    def _start(self) -> None:
        self._join(None)
        seq, self.seq = self.seq, self.seq + 1
        self._clock = time.monotonic()
        path = os.path.join(self.directory, series.dir_name(seq))
        replay = self.replay
        t0 = time.perf_counter()
        self._prune_old()
        body = None
        try:
            snap = incremental.snapshot(replay, self.changes, self._base, path, self.copy_limit, self._copies)
            if replay.rank == 0:
                from .protocol import _manifest_body  # the body save() writes, with this moment's streams
                body = _manifest_body(replay, [])
                body["sequence"] = seq
        except Exception as e:  # the next checkpoint writes everything again
            self._base = None
            self._lost = True
            self._error = self._error or CheckpointError(f"background checkpoint {path}: {e}")
            log.warning("background checkpoint %s: snapshot failed on rank %d: %s", path, replay.rank, e)
            try:
                series.write_marker(os.path.join(path, rank_dir(replay.rank)), series.FAILED,
                                    {"rank": replay.rank, "error": str(e)})
            except Exception:
                pass
            return
        self.started += 1
        self.last = {"sequence": seq, "changed": snap.changed, "linked": snap.linked, "to_write": snap.to_write,
                     "loop_seconds": time.perf_counter() - t0}
        deadline = replay.comm.timeout + 4.0 * snap.to_write / assumed_rate()
        if self.write_rate is not None:
            deadline += 2.0 * snap.to_write / self.write_rate
        if self.cpu_share is not None:  # a core hashes and writes 100 MB/s at the least, the thread a share of it
            deadline += 2.0 * snap.to_write / (1e8 * self.cpu_share)
        self._snap = snap
        self._pacer = pacing.Pacer(self.write_rate, self.cpu_share)
        self._thread = threading.Thread(target=self._run, args=(snap, path, seq, body, deadline),
                                        name=f"gear_mpi-checkpoint-{seq}", daemon=True)
        self._thread.ended = threading.Event()  # its last act: _join waits on it (see there)
        self._thread.written = threading.Event()  # this rank's files are written, or failed (_agree)
        self._thread.stop = threading.Event()  # rank 0: stop waiting for the other ranks' files (_agree)
        self._thread.start()

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self, snap: incremental.Snapshot, path: str, seq: int, body: dict | None, deadline: float) -> None:
        t0 = time.monotonic()
        pacer = self._pacer
        me = threading.current_thread()
        if self.priority in ("low", "nice"):
            pacing.lower_priority(idle=self.priority == "low")
        try:
            try:
                _, self._base = incremental.write(snap, pacer)
            except BaseException:
                self._lost = True
                raise
            finally:
                me.written.set()
            if body is not None:  # rank 0: every rank's files, then the manifest, then the old ones go
                shards = series.collect(path, self.replay.ranks, time.monotonic() + deadline, stop=me.stop)
                body["shards"] = shards
                body["items"] = sum(int(s["items"]) for s in shards)
                series.install(path, body, PARTED_VERSION)
                self._prune = True  # by the training thread, at the next start or wait: fewer GIL handovers here
            self.completed += 1
            self.last.update(thread_seconds=time.monotonic() - t0, paced_seconds=pacer.slept,
                             copied_in_loop=snap.copied, written_in_loop=snap.written_now,
                             table_written=snap.table_written, table_linked=snap.table_linked)
            log.info("background checkpoint %s: rank %d wrote %s, linked %s in %.2f s", path, snap.rank,
                     human(snap.to_write), human(snap.linked), time.monotonic() - t0)
        except BaseException as e:
            self._base = None if self._base is None or not os.path.isdir(self._base.directory) else self._base
            if not me.stop.is_set():  # stopped: another rank's files failed, and that rank reports why
                self._error = self._error or (e if isinstance(e, CheckpointError) else CheckpointError(
                    f"background checkpoint {path}: {type(e).__name__}: {e}"))
            log.warning("background checkpoint %s failed on rank %d: %s", path, snap.rank, e)
        finally:
            if self._snap is snap:
                self._snap = None
            threading.current_thread().ended.set()

    def _prune_old(self) -> None:
        """Rank 0, training thread, no checkpoint being written: delete all but the newest ``keep`` complete ones
        (:func:`~gear_mpi.checkpoint.series.prune`; an unlink per file, about 10 us each). Never raises."""
        if self._prune:
            self._prune = False
            try:
                series.prune(self.directory, self.keep)
            except OSError as e:
                log.warning("background checkpoints: pruning %s failed: %s", self.directory, e)

    def _join(self, timeout: float | None) -> None:
        if self._thread is not None:
            pacer = self._pacer
            if pacer is not None:  # the loop waits for it now: no more pacing, its priority back where allowed
                pacer.hurry = True
            # its own event, not Thread.join alone: CPython 3.11 takes a thread for ended once a signal
            # (KeyboardInterrupt) interrupted a join of it, and the next join returns at once while it writes
            if self._thread.ended.wait(timeout):
                self._thread.join()
                self._thread = None

    def _agree(self, values, prune: bool = False) -> None:
        """Collective: wait for this rank's checkpoint in flight, then raise the same error on every rank if one
        failed anywhere since the last call (as :meth:`MpiComm.agree`).

        Two agreements: first each rank's own files (written, or failed: ``_lost``), then rank 0's install. Rank 0's
        thread waits for every rank's files; rank 0 waits for it here, locally (a KeyboardInterrupt there leaves no
        collective pending), but at most a quarter of ``timeout`` past its own files before it joins the first
        agreement: told there that a rank's files will never come (a full disk may not even let that rank write
        ``failed.json``), the thread stops waiting at once, instead of at its deadline, past the other ranks'
        ``timeout``.

        Args:
            values: the second agreement's head values (:meth:`Calls.agree`); prune: rank 0 prunes old checkpoints
                (:meth:`_prune_old`) once its thread has ended.
        Raises:
            CheckpointError: a background checkpoint failed on some rank (the same on every rank).
            CollectiveTimeoutError, CollectiveError: as every collective of the replay.
        """
        thread = self._thread
        if thread is not None:
            if self._pacer is not None:
                self._pacer.hurry = True
            thread.written.wait()
            thread.ended.wait(self.replay.comm.timeout / 4)  # rank 0: the other ranks' files, as a rule
        table = self.replay.calls.agree(None, "checkpoints", [1.0 if self._lost else 0.0])
        self._lost = False
        if thread is not None and float(table[:, 0].max()) > 0:
            thread.stop.set()
        self._join(None)
        if prune:
            self._prune_old()
        err, self._error = self._error, None
        self.replay.calls.agree(err, "checkpoints", values)

    # ---- collective calls -------------------------------------------------------------------------
    def now(self) -> int:
        """Collective: start a checkpoint now (after the previous one is written), whatever the clock says.

        Returns:
            Its number (the directory ``ckpt-NNNNNNNN``).
        Raises:
            CheckpointError: an earlier background checkpoint failed on some rank (every rank; that one
                is not started again; this one starts nonetheless).
            CollectiveTimeoutError, CollectiveError: as every collective of the replay.
        Cost: waits for this rank's previous checkpoint; two head allgathers (:meth:`_agree`); a snapshot
        (:meth:`after_sample`).
        """
        seq = self.seq
        try:
            self._agree([seq])
        except CheckpointError:  # an earlier one failed (agreed): this one starts all the same
            self._start()
            raise
        self._start()
        return seq

    def wait(self) -> Path | None:
        """Collective: wait until the checkpoint being written (if any) is complete on every rank.

        Returns:
            The newest complete checkpoint in the directory (the same on every rank), or None.
        Raises:
            CheckpointError: a background checkpoint failed on some rank since the last ``wait`` or ``now``
                (the same on every rank; the checkpoints before it stay complete and loadable).
            CollectiveTimeoutError, CollectiveError: as every collective of the replay.
        Cost: blocks for this rank's thread (rank 0: until the manifest is written, then deletes the
        checkpoints past ``keep``); two head allgathers (:meth:`_agree`).
        """
        self._agree([0], prune=True)
        return series.latest(self.directory)

    def stop(self) -> Path | None:
        """Collective: :meth:`wait`, then stop taking checkpoints (the replay forgets this handle).

        Returns:
            As :meth:`wait`.
        Raises:
            As :meth:`wait` (the handle is stopped nonetheless).
        """
        try:
            return self.wait()
        finally:
            self.detach()

    def detach(self, timeout: float | None = None) -> None:
        """Local: stop recording changes and forget the replay (``Replay.close`` calls it), waiting at most
        ``timeout`` seconds (None: no limit) for this rank's checkpoint in flight. Idempotent."""
        self._join(timeout)
        snap = self._snap
        if snap is not None:  # still being written (a dead peer's files awaited?): no more reads of the shard
            snap.release()
        replay = self.replay
        if replay is None:
            return
        if replay.shard.store is not None and replay.shard.store.on_write == self._on_write:
            replay.shard.store.on_write = None
        if getattr(replay, "_checkpoints", None) is self:
            replay._checkpoints = None

    def __repr__(self) -> str:
        return (f"BackgroundCheckpoints({self.directory!r}, seconds={self.seconds}, keep={self.keep}, "
                f"started={self.started}, completed={self.completed})")


def start(replay, directory, seconds: float | None, keep: int, segment_bytes: int, copy_limit: int,
          write_rate: float | None = None, cpu_share: float | None = None,
          priority: str = "low") -> BackgroundCheckpoints:
    """Collective: check the arguments alike on every rank and attach a :class:`BackgroundCheckpoints`.

    Args:
        replay, directory, seconds, keep, segment_bytes, copy_limit: as ``Replay.checkpoint_every``.
        write_rate: bytes a second each rank's thread writes at most (:class:`~gear_mpi.checkpoint.pacing.Pacer`;
            None: no limit). cpu_share: the fraction of a core each rank's thread uses at most (None: no
            limit); both kept by sleeping between small chunks. priority: ``"low"`` (the thread runs ``SCHED_IDLE``, else at nice 19:
            :func:`~gear_mpi.checkpoint.pacing.lower_priority`), ``"nice"`` (nice 19) or ``"normal"``.
    Returns:
        The handle, attached to the replay.

    Raises:
        TypeError, ValueError: bad arguments, or different ones on different ranks (every rank; the
            directories compared after ``os.path.abspath``, so a relative one from other working directories
            differs too).
        CheckpointError: the directory cannot be created on some rank (every rank).
    """
    replay._check_open()  # a closed replay: its error, before any communication
    err, first, where = None, 0, 0
    try:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds >= 0):
            raise ValueError(f"seconds must be a number >= 0 or None, got {seconds!r}")
        if seconds is not None and replay.mode == "local":
            raise ValueError("checkpoint_every: a replay built with mode='local' makes no collective sample to "
                             "carry the schedule; pass seconds=None and call .now() between steps")
        for name, v, low in (("keep", keep, 1), ("segment_bytes", segment_bytes, 1), ("copy_limit", copy_limit, 0)):
            check_count(v, name, low)
        pacing.Pacer(write_rate, cpu_share)  # raises ValueError for a bad rate or share
        if priority not in ("low", "nice", "normal"):
            raise ValueError(f"priority must be 'low', 'nice' or 'normal', got {priority!r}")
        if getattr(replay, "_checkpoints", None) is not None:
            raise ValueError("checkpoint_every: this replay already has background checkpoints; stop() them first")
        directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint_every: cannot create {directory}: {e}") from None
        first = series.next_number(directory)
        where = path_digest(directory)  # compared below, as save's path
    except Exception as e:
        err = e
    values = [0.0] * 5 if err is not None else [  # (a refused argument may be no number: agreed as it is)
        -1.0 if seconds is None else float(seconds), float(keep), float(segment_bytes), float(first), float(where)]
    table = replay.calls.agree(err, "checkpoints", values)
    others = differing_ranks(table[:, 4])
    if others:  # each rank would write under its own directory, and rank 0 wait for files that never come
        raise ValueError(f"checkpoint_every: every rank must give the same directory (after os.path.abspath); "
                         f"rank(s) {others} gave another than rank 0's: no checkpoint was started")
    if len({tuple(row) for row in table[:, :3].tolist()}) > 1:
        raise ValueError(f"checkpoint_every: seconds, keep and segment_bytes must be the same on every rank, got "
                         f"{table[:, :3].tolist()} (rank r's at position r)")
    handle = BackgroundCheckpoints(replay, os.path.abspath(os.fspath(directory)), seconds, int(keep),
                                   int(segment_bytes), int(copy_limit), int(table[:, 3].max()),
                                   None if write_rate is None else float(write_rate),
                                   None if cpu_share is None else float(cpu_share), priority)
    replay._checkpoints = handle
    return handle

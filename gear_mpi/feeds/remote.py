"""Actors on other nodes: episodes sent to a learner rank over MPI point-to-point.

On a cluster, actors often run on other nodes than the learners. They are ranks of
the same job (e.g. ``COMM_WORLD`` split into actors and learners): an actor rank
opens ``MpiWriter(comm, learner)`` -- the interface of :class:`~gear_mpi.feeds.writer.Writer`
-- and the learner rank calls ``replay.accept_remote(comm)`` once; the learner then
takes the actors' episodes at its collectives (or ``replay.ingest()``), within its
rate limiter's insert budget, like a local writer's. No server, no extra thread.

The protocol (tags :data:`TAGS` on ``comm``; give the replay a ``comm.Dup()`` made on
every rank if the job uses those tags or ``MPI.ANY_TAG`` receives on ``comm``):

- HELLO (actor -> learner, empty); the learner answers SPEC (the spec as JSON) at its
  next drain; the actor's constructor waits for it (``timeout``).
- EPISODE: one message per ended episode: ``int64 length``, ``float64 priority``, then
  each column's ``length`` steps, back to back. Non-blocking sends, at most
  ``max_in_flight`` episodes not yet acknowledged; the learner sends ACK (the count it
  has stored) per drain, so an actor blocks (backpressure) when the learner does not
  keep up, and raises WriterTimeoutError after ``timeout``.
- Goodbye, a handshake, so that no message is ever left unreceived on ``comm`` (MPICH's
  ``MPI_Finalize`` fails on a communicator holding one, and its launcher then kills the job):
  the actor's ``close`` sends BYE (``int64``: the episodes it sent) and waits until the
  learner has received them all and answers FAREWELL (an ACK message of value -2). A
  replay that closes first sends CLOSED (an ACK of value -1) to its actors, receives and
  drops what they still send until each one's BYE (an actor answers CLOSED with BYE at
  its next call, then raises WriterError), for at most its ``timeout``; ACK, FAREWELL and
  CLOSED share a tag, so an actor receives them in the order they were sent.

A dead rank (under ULFM: Open MPI's ``mpiexec --with-ft ulfm``, where the survivors go on): an actor whose
learner died raises WriterError at its next call that talks to the learner (MPI reports the failure, or no
acknowledgement comes within ``timeout``: WriterTimeoutError); its open episode and unacknowledged ones are
lost. A learner whose ``comm`` lost a rank (an actor, or another learner) acknowledges the failure (so that
its receives from any source work again; a probe or receive that MPI fails for a failure it has not listed
yet is tried again, up to :data:`FAILURE_RETRIES` times), forgets the dead actors and goes on taking the
others' messages (each taken with a matched probe, ``MPI_Improbe``: a dead actor's message is consumed once
and dropped, never met again in front of the others');
``Replay.recover`` hands the inboxes to the survivors' new replay, so an actor of a surviving learner goes on.
Without ULFM the launcher ends the whole job when a rank dies.

Costs: an actor copies each episode once into its send buffer; the learner receives
it into one buffer per episode and copies it once into its shard (one
``store_packed`` per drain).
"""
from __future__ import annotations

import json
import time
import warnings

import numpy as np

from ..distributed.comm import check_timeout
from ..distributed.deadline import _process_failed, poll
from ..errors import WriterError, WriterTimeoutError, not_copyable
from ..spec import TrajectorySpec, check_count, whole_number
from .writer import EpisodeWriter

TAG_HELLO, TAG_SPEC, TAG_EPISODE, TAG_ACK, TAG_BYE = range(31000, 31005)
TAGS = (TAG_HELLO, TAG_SPEC, TAG_EPISODE, TAG_ACK, TAG_BYE)
CLOSED, FAREWELL = -1, -2  # ACK values: the replay closed; the actor's BYE is answered (the learner's last word)
FAILURE_RETRIES = 5  # tries again after acknowledging a failure (RemoteInbox._retry)
_HEAD = 16  # bytes before an episode's columns: length (int64), priority (float64)


def _mpi():
    from mpi4py import MPI
    return MPI


def acknowledge_failures(comm) -> list[int]:
    """ULFM: acknowledge the processes of ``comm`` known to have failed, so that receives and probes from
    ``MPI.ANY_SOURCE`` work again, and return their ranks in ``comm``. Local, O(failed ranks).

    The failed group is read first and exactly its members are acknowledged, so a failure that MPI notices
    between the two calls is neither acknowledged nor returned (the next call takes it).

    Raises:
        NotImplementedError: this mpi4py has neither ``Comm.Ack_failed`` (MPI 5 / ULFM) nor ``Failure_ack``.
    """
    MPI = _mpi()
    if hasattr(comm, "Ack_failed"):
        group = comm.Get_failed()
        comm.Ack_failed(group.Get_size())  # the first n of that group, in its order (MPI 5)
    elif hasattr(comm, "Failure_ack"):
        comm.Failure_ack()
        group = comm.Failure_get_acked()
    else:
        raise NotImplementedError("this mpi4py cannot acknowledge failed processes (no ULFM)")
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), comm.Get_group())]
    finally:
        group.Free()


class MpiWriter(EpisodeWriter):
    """A writer on an actor rank, sending episodes to rank ``learner`` of ``comm`` (see the module docstring).

    Args:
        comm: an mpi4py communicator holding this rank and the learner (e.g. ``MPI.COMM_WORLD``).
        learner: the learner's rank in ``comm``; it must call ``replay.accept_remote(comm)``.
        timeout: seconds to wait for the learner's answer (to the first HELLO, and to the goodbye of
            :meth:`close`), and for room when ``max_in_flight`` episodes are unacknowledged.
        max_in_flight: episodes sent and not yet stored by the learner before ``end_episode`` blocks.
        check_finite: refuse NaN and infinite step values, as :class:`~gear_mpi.feeds.writer.Writer` does.
    Raises:
        ValueError: a bad argument. WriterTimeoutError: the learner did not answer within ``timeout``.
        WriterError: MPI failed a call to the learner (it died; under ULFM). The same from any later call
        that talks to the learner (``end_episode``, ``insert``, ``flush``): the writer is then closed.
    Cost: ``max_length * step_bytes`` for the open episode, up to ``max_in_flight`` episode buffers in flight.
    """

    __reduce_ex__ = not_copyable("an MpiWriter (it sends over an MPI communicator)",
                                 "build one on each actor rank, from that rank's communicator")

    def __init__(self, comm, learner: int, *, timeout: float = 60.0, max_in_flight: int = 8,
                 check_finite: bool = False):
        check_timeout(timeout)
        max_in_flight = check_count(max_in_flight, "max_in_flight")
        if not (whole_number(learner, 0) and learner < comm.Get_size()) or learner == comm.Get_rank():
            raise ValueError(f"learner must be another rank of comm (0..{comm.Get_size() - 1}), got {learner!r}")
        self.comm, self.learner, self.timeout = comm, int(learner), float(timeout)
        self.max_in_flight = int(max_in_flight)
        self._MPI = _mpi()
        self._sends: list = []  # (request, buffer) of episodes and control messages in flight
        self._acked = 0
        self._closed = False
        self._said_bye = False  # BYE sent
        self._answered = False  # the learner's last word (FAREWELL or CLOSED) received: it sends nothing more
        self._learner_closed = False  # that word was CLOSED
        self._send(np.zeros(1, np.uint8), TAG_HELLO)
        status = self._MPI.Status()
        try:
            if not poll(lambda: comm.Iprobe(source=self.learner, tag=TAG_SPEC, status=status), self.timeout):
                raise WriterTimeoutError(f"MpiWriter: learner rank {learner} did not answer within {timeout:g} s "
                                         f"(did it call replay.accept_remote(comm) and reach a collective?)")
            buf = np.empty(status.Get_count(self._MPI.BYTE), np.uint8)
            comm.Recv(buf, source=self.learner, tag=TAG_SPEC)
        except self._MPI.Exception as e:
            raise self._lost(e) from None
        spec = TrajectorySpec.from_dict(json.loads(bytes(buf)))
        self._buffer = {c.name: np.empty((spec.max_length,) + c.shape, c.dtype) for c in spec.columns}
        self._setup(spec, self._buffer, check_finite)

    def _lost(self, e: Exception) -> WriterError:
        """The learner is gone (MPI failed a call to it, e.g. ULFM's MPI_ERR_PROC_FAILED): close this writer."""
        lost = self._episodes - self._acked if hasattr(self, "_episodes") else 0
        self._closed, self._max_length, self._sends, self._answered = True, 0, [], True
        return WriterError(f"MpiWriter: learner rank {self.learner} is gone (MPI: {e}); the open episode and "
                           f"{lost} episode(s) it had not stored are lost")

    def _send(self, buf: np.ndarray, tag: int) -> None:
        try:
            self._sends.append((self.comm.Isend(buf, dest=self.learner, tag=tag), buf))
        except self._MPI.Exception as e:
            raise self._lost(e) from None

    def _listen(self) -> None:
        """Take the learner's ACK, FAREWELL and CLOSED messages; drop completed sends.

        Raises:
            WriterError: the replay was closed (the first call that sees it), or MPI failed a call to the
                learner (it died).
        """
        try:
            self._take_messages()
        except self._MPI.Exception as e:
            raise self._lost(e) from None
        if self._learner_closed and not self._closed:
            self._closed, self._max_length = True, 0
            raise WriterError(f"MpiWriter: the replay of learner rank {self.learner} was closed")

    def _take_messages(self) -> None:
        """Receive every learner message that has arrived (one tag: in the order sent); answer CLOSED with BYE."""
        comm, word = self.comm, np.empty(1, np.int64)
        while comm.Iprobe(source=self.learner, tag=TAG_ACK):
            comm.Recv(word, source=self.learner, tag=TAG_ACK)
            value = int(word[0])
            if value >= 0:
                self._acked = max(self._acked, value)
                continue
            self._answered = True
            if value == CLOSED:
                self._learner_closed = True
                if not self._said_bye:
                    self._bye()
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _bye(self) -> None:
        """Send BYE with the number of episodes sent: the learner answers once it has received them all."""
        self._said_bye = True
        self._sends.append((self.comm.Isend(b := np.array([self._episodes], np.int64), dest=self.learner,
                                            tag=TAG_BYE), b))

    def _room(self, steps: int) -> None:
        if self._closed:
            raise WriterError("MpiWriter: this writer is closed")
        self._fits = self.spec.max_length

    def _rows(self, count: int):
        return [(self._buffer, slice(0, count))]

    def _publish(self, length: int, priority: float) -> None:
        self._listen()
        if self._episodes - self._acked >= self.max_in_flight:
            def room() -> bool:
                self._listen()
                return self._episodes - self._acked < self.max_in_flight
            if not poll(room, self.timeout):
                raise WriterTimeoutError(f"MpiWriter: learner rank {self.learner} stored none of {self.max_in_flight} "
                                         f"episodes in flight within {self.timeout:g} s (it is not reaching its "
                                         f"collectives, or its rate limiter holds inserts back)")
        parts = [np.array([length], np.int64).view(np.uint8), np.array([priority], np.float64).view(np.uint8)]
        parts += [self._buffer[c.name][:length].reshape(-1).view(np.uint8) for c in self.spec.columns]
        self._send(np.concatenate(parts), TAG_EPISODE)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the learner has stored every ended episode.

        Raises:
            WriterTimeoutError: not in time; WriterError: the replay was closed.
        """
        def done() -> bool:
            self._listen()
            if self._learner_closed and self._acked < self._episodes:
                raise WriterError(f"flush: the replay of learner rank {self.learner} was closed; it stored "
                                  f"{self._acked} of {self._episodes} episodes")
            return self._acked >= self._episodes
        if not poll(done, self.timeout if timeout is None else timeout):
            raise WriterTimeoutError(f"flush: learner rank {self.learner} stored {self._acked} of {self._episodes} "
                                     f"episodes in time")

    def close(self) -> None:
        """Say goodbye (BYE) and wait for the learner's answer: it answers once it has received every episode
        sent (at its next collective or ``ingest`` after they arrive), or when its replay closes. So nothing
        is left unreceived on ``comm`` (see the module docstring). An open episode is dropped. Idempotent;
        where the learner is gone (MPI fails the calls), there is nobody to wait for: it returns at once.

        Raises:
            WriterTimeoutError: no answer within ``timeout`` (the learner is not reaching its collectives).
        """
        if self._answered and not self._sends:
            self._closed = True
            return
        if not self._closed:
            super().close()

        def answered() -> bool:
            self._take_messages()
            return self._answered and bool(self._MPI.Request.Testall([r for r, _ in self._sends]))
        try:
            if not self._said_bye and not self._answered:
                self._bye()
            ok = poll(answered, self.timeout)
        except self._MPI.Exception:  # the learner is gone: nothing left to complete
            ok = True
        self._sends = []
        self._answered = True
        if not ok:
            raise WriterTimeoutError(f"MpiWriter.close: learner rank {self.learner} did not answer the goodbye "
                                     f"within {self.timeout:g} s: it must reach a collective (or ingest) after "
                                     f"receiving this writer's {self._episodes} episodes, or close its replay")


class RemoteInbox:
    """The learner's side: answers actors, receives their episodes into the shard (see the module docstring).

    Args:
        comm: the communicator the actors' :class:`MpiWriter` use.
        shard: the shard the episodes enter.
        timeout: seconds :meth:`close` waits for the actors' goodbyes.
    """

    def __init__(self, comm, shard, timeout: float = 60.0):
        self.comm, self.shard, self._MPI, self.timeout = comm, shard, _mpi(), float(timeout)
        self.actors: dict[int, list[int]] = {}  # rank -> [episodes received, episodes stored]
        self._byes: dict[int, int] = {}  # actor rank -> episodes it sent in all (its BYE), until all are received
        self._closing = False  # close() began: every actor was sent CLOSED and gets no other message
        self._sends: list = []
        self._spec = np.frombuffer(json.dumps(shard.spec.to_dict()).encode(), np.uint8).copy()
        self._sizes = [(c.name, c.dtype, c.shape, c.step_bytes) for c in shard.spec.columns]
        self.ingested = 0
        self.failed: set[int] = set()  # ranks of comm that died (ULFM), acknowledged here
        self._held = None  # an episode matched (MPI_Improbe) that the last drain had no room for

    def _failure(self, e: Exception) -> None:
        """MPI reported a dead rank of ``comm`` (ULFM): acknowledge what has failed and forget those ranks as
        actors; re-raise ``e`` when it is not that."""
        if not _process_failed(e):
            raise e
        try:
            gone = set(acknowledge_failures(self.comm)) - self.failed
        except Exception:
            raise e from None
        self.failed |= gone
        for r in gone:
            self.actors.pop(r, None)

    def _retry(self, op):
        """``op()`` (a probe); where MPI reports a dead rank (ULFM), acknowledge it and try again, up to
        ``FAILURE_RETRIES`` times (MPI may report a failure before it lists the rank as failed). Returns
        ``op()``'s result."""
        for attempt in range(FAILURE_RETRIES + 1):
            try:
                return op()
            except self._MPI.Exception as e:
                if attempt == FAILURE_RETRIES:
                    raise
                self._failure(e)
                if attempt:
                    time.sleep(0.001 * 2 ** attempt)

    def _probe(self, source: int, tag: int, status=None) -> bool:
        """``comm.Iprobe``, going on past ranks that died (acknowledged: :meth:`_failure`)."""
        return bool(self._retry(lambda: self.comm.Iprobe(source=source, tag=tag, status=status)))

    def _match(self, tag: int):
        """The next message of ``tag`` from any rank, matched (``MPI_Improbe``: only :meth:`_take` receives it),
        as ``(message, source, bytes)``; None when there is none. Goes on past ranks that died."""
        status = self._MPI.Status()
        message = self._retry(lambda: self.comm.Improbe(source=self._MPI.ANY_SOURCE, tag=tag, status=status))
        if message is None or message == self._MPI.MESSAGE_NULL:
            return None
        return message, status.Get_source(), status.Get_count(self._MPI.BYTE)

    def _take(self, message, buf: np.ndarray) -> bool:
        """Receive a matched message into ``buf``; False where its sender died before it all arrived (the
        message is gone then: a later probe cannot meet it again)."""
        try:
            message.Recv(buf)
            return True
        except self._MPI.Exception as e:
            self._failure(e)  # anything but a dead sender is raised
            return False

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        try:
            self._sends.append((self.comm.Isend(buf, dest=dest, tag=tag), buf))
        except self._MPI.Exception as e:  # a dead actor: nothing to tell it
            self._failure(e)

    def _done(self, request) -> bool:
        """Whether a send completed; a send to a rank that died counts as done (dropped)."""
        try:
            return request.Test()
        except self._MPI.Exception as e:
            if not _process_failed(e):
                raise
            try:
                self._failure(e)
            except self._MPI.Exception:
                pass  # that failure was acknowledged already
            return True

    def _control(self) -> None:
        """Take every HELLO (answered with the spec) and BYE waiting, each with a matched probe: the message of
        an actor that died is consumed once and dropped, never met again in front of the live actors' ones.
        Answer the goodbyes whose episodes have all been received."""
        while (found := self._match(TAG_HELLO)) is not None:
            message, src, _ = found
            if self._take(message, np.empty(1, np.uint8)):
                self.actors[src] = [0, 0]
                self._send(self._spec, src, TAG_SPEC)
                if self._closing:
                    self._tell_closed(src)
        while (found := self._match(TAG_BYE)) is not None:
            message, src, _ = found
            sent = np.zeros(1, np.int64)
            if self._take(message, sent) and src in self.actors:
                self._byes[src] = int(sent[0])
        self._answer_goodbyes()
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if not self._done(r)]

    def _answer_goodbyes(self) -> None:
        """Forget each actor that said BYE and whose episodes have all been received; FAREWELL to it (unless the
        inbox is closing: it was told CLOSED and expects nothing more)."""
        if not self._byes:
            return
        for src, sent in list(self._byes.items()):
            counts = self.actors.get(src)
            if counts is not None and counts[0] < sent:
                continue
            del self._byes[src]
            if counts is not None:
                if not self._closing:
                    self._send(np.array([FAREWELL], np.int64), src, TAG_ACK)
                del self.actors[src]

    def _tell_closed(self, src: int) -> None:
        self._send(np.array([CLOSED], np.int64), src, TAG_ACK)

    def _drop(self, message, src: int, nbytes: int) -> None:
        """Receive a matched episode and drop it (the inbox is closing); it counts as received from ``src``."""
        if self._take(message, np.empty(nbytes, np.uint8)) and src in self.actors:
            self.actors[src][0] += 1

    def backlog(self) -> int:
        """1 when an episode is waiting to be received, else 0 (MPI shows one message at a time). O(1)."""
        self._control()
        return int(self._held is not None or bool(self._probe(self._MPI.ANY_SOURCE, TAG_EPISODE)))

    def drain(self, budget: float) -> int:
        """Receive up to ``budget`` episodes into the shard, then acknowledge them. Local.

        Every episode that has arrived is taken (within ``budget``): in batches of what the shard holds at
        once (``max_items``, ``capacity_steps``), one store_packed each, the oldest evicted as by single
        inserts. Acknowledged once, at the end: an actor sends at most ``max_in_flight`` episodes ahead of its
        acknowledgements, so the drain ends.

        Returns:
            How many entered.
        Raises:
            WriterError: a message that is not a well-formed episode of this spec (names the actor rank; it is
                dropped, and the episodes received before it are stored and acknowledged first).
        """
        self._control()
        total, senders = 0, set()
        try:
            while total < budget and (n := self._batch(budget - total, senders)):
                total += n
        finally:  # what entered is acknowledged, even when a later message was refused
            for src in senders - self.failed:
                self._send(np.array([self.actors[src][1]], np.int64), src, TAG_ACK)
            self._answer_goodbyes()
        return total

    def _batch(self, budget: float, senders: set) -> int:
        """Receive up to ``budget`` episodes, at most what the shard holds at once, into the shard (one
        store_packed); add their senders to ``senders``. Returns how many entered."""
        spec, store = self.shard.spec, self.shard.store
        got, lengths, priorities, srcs, steps, bad = [], [], [], [], 0, None
        while len(got) < budget and len(got) < store.max_items:
            held = self._held if self._held is not None else self._match(TAG_EPISODE)
            if held is None:
                break
            message, src, nbytes = held
            head = (nbytes - _HEAD) // max(spec.step_bytes, 1)
            if got and steps + head > store.capacity:
                self._held = held  # the next batch takes it (a first one that cannot fit is read, and refused)
                break
            self._held = None
            buf = np.empty(nbytes, np.uint8)
            if not self._take(message, buf):
                continue  # its sender died before the episode arrived: never acknowledged, not held
            if nbytes < _HEAD:
                length, priority = 0, 0.0
            else:
                length, priority = int(buf[:8].view(np.int64)[0]), float(buf[8:16].view(np.float64)[0])
            if not (1 <= length <= spec.max_length) or nbytes != _HEAD + length * spec.step_bytes or \
                    not (priority >= 0 and np.isfinite(priority)):
                # raised once the episodes received before it are stored: they are the other actors', and taken
                bad = WriterError(f"accept_remote: rank {src} sent a message of {nbytes} bytes that is not an "
                                  f"episode of this spec (dropped)")
                if src in self.actors:
                    self.actors[src][0] += 1  # received (its BYE counts it), never stored nor acknowledged
                break
            got.append(buf)
            lengths.append(length)
            priorities.append(priority)
            srcs.append(src)
            steps += length
        if not got:
            if bad is not None:
                raise bad
            return 0
        columns, offsets = {}, np.full(len(got), _HEAD)
        for name, dtype, shape, nb in self._sizes:
            parts = [b[o:o + n * nb] for b, o, n in zip(got, offsets, lengths)]
            columns[name] = np.concatenate(parts).view(dtype).reshape((-1,) + shape)
            offsets += np.array(lengths) * nb
        self.shard.store_packed(columns, np.array(lengths, np.int64), np.array(priorities, np.float64))
        for src in srcs:
            counts = self.actors.setdefault(src, [0, 0])
            counts[0] += 1  # received
            counts[1] += 1  # stored
        senders.update(srcs)
        self.ingested += len(got)
        if bad is not None:
            raise bad
        return len(got)

    def close(self) -> None:
        """Tell every actor the replay is closed (CLOSED), then receive and drop what they still send until each
        one's BYE, for at most ``timeout`` seconds: nothing is left unreceived on ``comm``. Local.

        Warns (RuntimeWarning) naming the actors that did not answer in time (an actor answers at its next
        ``end_episode``, ``insert``, ``flush`` or ``close``): their messages stay on ``comm``, which MPICH's
        ``MPI_Finalize`` refuses. Close the actors' writers first, or keep them calling.
        """
        self._closing = True
        try:
            if self._held is not None:  # a matched message must be received: its episode is dropped, never acknowledged
                held, self._held = self._held, None
                self._drop(*held)
            for src in list(self.actors):  # (a send to a dead actor forgets it: _failure)
                self._tell_closed(src)

            def finished() -> bool:
                self._control()
                while (found := self._match(TAG_EPISODE)) is not None:  # in flight: received and dropped
                    self._drop(*found)
                self._answer_goodbyes()
                return not self.actors and all([self._done(r) for r, _ in self._sends])
            done = poll(finished, self.timeout)  # at least one look: a HELLO that came just now is answered too
        except self._MPI.Exception:  # a revoked or broken communicator: nothing more can be received
            done = True
        if not done and self.actors:
            warnings.warn(f"RemoteInbox.close: actor rank(s) {sorted(self.actors)} did not answer CLOSED within "
                          f"{self.timeout:g} s; what they send now stays unreceived on the communicator, which "
                          f"MPICH's MPI_Finalize refuses (close the actors' MpiWriter before the replay)",
                          RuntimeWarning, stacklevel=2)
        self._sends = []
        self.actors, self._byes = {}, {}

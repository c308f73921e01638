"""A replay's collective calls: each one begins with a head of one size that says which call it is.

Every collective of a :class:`~gear_mpi.replay.Replay` over its communicator -- ``sample`` (``out=``,
the ``batches()`` thread's and a per-call ``mode="local"`` included), the ``batches()`` thread's deferred
updates, ``update_priorities``, ``get_many``, ``stats``, ``save`` and ``RateMeter(replay)`` -- sends the
same first message: a *head* of :data:`WIDTH` float64 per rank, agreed in one allgather (through the
node board's shared memory when every rank is on one node: :class:`~gear_mpi.distributed.node.NodeBoard`):

- column 0, the rank's status: ``-1`` when its arguments are fine, else the class of its error
  (:meth:`MpiComm.agree <gear_mpi.distributed.comm.MpiComm.agree>`: the lowest failing rank's error is
  raised on every rank);
- column 1, the call: ``number * 64 + operation``, where ``number`` counts the replay's collectives
  (1, 2, ...; the same on every rank while they call alike) and ``operation`` is the index of the
  call's name in :data:`OPS`;
- up to :data:`VALUES` numbers of the call (a sample's header, an update's "only my own keys", a
  save's token and byte count; zeros after them).

A head has this size whatever the call, so heads of different calls still meet each other whole, and
every rank compares the calls before it reads anything else of the table: when they differ, every rank
raises the same :class:`~gear_mpi.errors.CollectiveError`, which names each rank's call -- ``collective
mismatch: rank 0 called update_priorities (call #7), rank 1 called stats (call #7); ...`` -- instead
of reading another call's numbers as its own (before, such ranks returned wrong results, raised
``ValueError``s, or timed out). It costs no message: a sample's allgather carries 112 bytes a rank
instead of 104 (the call), an update's or a fetch's 112 instead of 16 or 8 (a fixed size), and on one
node every head is a row of the node board (no MPI call; before, only a sample's was).

Calls with more to share than a head holds (``stats``' row of figures, a deferred update's counts and
keys) post that *payload* as a second allgather right behind the head, both in flight together (one
rendezvous), and read it only once the heads matched.

After a mismatch the replay cannot communicate any more (``MpiComm.broken``): every later call raises
CollectiveError at once and ``close()`` closes locally. The ranks are at different points of their
programs, and a payload posted behind a head may be left pending: a later collective on the
communicator would meet it. So when some rank's call posts one (:data:`PAYLOADS`), every rank records the
communicator as holding one (:func:`gear_mpi.distributed.deadline.mark_pending`: ``Replay.load`` on it
refuses at once, as after a timeout); the next replay belongs on another communicator. ``close()`` itself is not a head: its barrier runs on a
communicator of its own (:meth:`NodeView.closing_barrier <gear_mpi.distributed.node.NodeView.closing_barrier>`),
so a rank that closes while another calls something else makes both time out (CollectiveTimeoutError).
Calls that do not communicate (a sample of a replay built with ``mode="local"``, inserts, ``get``) are
not counted, and cannot be checked.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

from . import deadline
from .. import errors
from .comm import MpiComm, error_code

#: the replay's collectives, by the names their heads carry (a head's operation is the index here)
OPS = ("sample", "update_priorities", "update_priorities (batches)", "get_many", "stats", "save", "RateMeter", "clear",
       "checkpoints", "batches")
#: the calls that post a payload behind their head
PAYLOADS = ("update_priorities (batches)", "stats")
VALUES = 12  # numbers a head carries besides its status and call: a sample's header (distributed.header)
WIDTH = 2 + VALUES
_SPAN = 64  # a head's call: number * _SPAN + operation
SHOWN = 8   # different calls a mismatch's message names (the rest are counted)

_ABANDONED: list = []  # (request, buffers) of payloads left pending: MPI may still write into their buffers


def call_name(code: float) -> str:
    """What the call column ``code`` of a head says, for messages: ``"stats (call #7)"``. Local, O(1).

    Args:
        code: a head's column 1 (from any rank: not necessarily a call of this library).
    Returns:
        The call's name and number, or a phrase saying it is no replay call.
    """
    if not (math.isfinite(code) and code == int(code) and code >= _SPAN):
        return "something that is not a collective of this replay"
    number, op = divmod(int(code), _SPAN)
    if op >= len(OPS):
        return "something that is not a collective of this replay"
    return f"{OPS[op]} (call #{number})"


def _ranks(ranks: list[int]) -> str:
    """``"rank 3"``, ``"ranks 0-2, 5"``."""
    runs, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r is None or r != prev + 1:  # a run ends at prev
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def payload_pending(codes: list[float]) -> bool:
    """Whether a payload may be left pending after a mismatch of these calls: some rank's call posts one
    (:data:`PAYLOADS`), or is no call of this library. Local, O(ranks); the same on every rank.

    Args:
        codes: every rank's call column, as agreed.
    """
    for code in codes:
        name = call_name(code)
        if name.split(" (call #")[0] in PAYLOADS or " (call #" not in name:
            return True
    return False


def mismatch_message(codes: list[float]) -> str:
    """The message of a mismatch: which rank called what, grouped by call in rank order. Local, O(ranks).

    Args:
        codes: every rank's call column (row r from rank r), as agreed (the same list on every rank).
    Returns:
        The same text on every rank.
    """
    groups: dict[str, list[int]] = {}
    for r, code in enumerate(codes):
        groups.setdefault(call_name(code), []).append(r)
    said = [f"{_ranks(ranks)} called {name}" for name, ranks in list(groups.items())[:SHOWN]]
    if len(groups) > SHOWN:
        said.append(f"and {len(groups) - SHOWN} other calls")
    return (f"collective mismatch: {', '.join(said)}; every rank must make the replay's collective calls "
            f"in the same order (see docs/guide/collectives.md); the replay can no longer communicate (close it)")


def _replay_comms(replay) -> tuple:
    return (replay.calls.comm,)


def _replay_heads(replay) -> int:
    return replay.calls.count


def interrupt_breaks(what: str, comms: Callable = _replay_comms, started: Callable | None = _replay_heads) -> Callable:
    """Decorate a method whose call makes collectives: an interrupt (a ``BaseException`` that is not an
    ``Exception``: KeyboardInterrupt, SystemExit) that leaves it once its collectives have begun leaves the
    ranks out of step wherever it landed -- in a wait (:meth:`MpiComm.wait
    <gear_mpi.distributed.comm.MpiComm.wait>` marks that already) or between two collectives, where the others
    wait in the next one -- so the communicators are marked broken (:meth:`MpiComm.interrupted
    <gear_mpi.distributed.comm.MpiComm.interrupted>`): the rank's next call raises at once instead of posting a
    message that the others' pending collective could meet, the peers fail within their deadline, and
    ``close()`` is local. O(1) a call.

    Args:
        what: the call's name, for the message.
        comms: ``comms(owner)``, the communicators the call uses (None entries are skipped); default: a
            replay's.
        started: ``started(owner)``, a value that moves once the call has begun its collectives (a replay's
            head count, the default): an interrupt before that breaks nothing. None: any interrupt breaks.
    """
    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(owner, *args, **kwargs):
            before = None if started is None else started(owner)
            try:
                return method(owner, *args, **kwargs)
            except BaseException as e:
                if started is None or started(owner) != before:
                    mark_interrupted(comms(owner), what, e)
                raise
        return call
    return decorate


def mark_interrupted(comms, what: str, e: BaseException) -> None:
    """:func:`interrupt_breaks`' rule, for a call that began its collectives and is left by ``e``: where ``e`` is an
    interrupt (a ``BaseException`` that is not an ``Exception``), mark each of ``comms`` not already broken (None
    entries skipped) as interrupted in ``what``. Local, O(len(comms))."""
    if not isinstance(e, Exception):
        for comm in comms:
            if comm is not None and comm.broken is None:
                comm.interrupted(what, e)


class ReplayCalls:
    """The heads of a replay's collectives (see the module docstring): their count, and the agreement.

    One per replay, used by one thread at a time (the replay's, or its ``batches()`` thread while that
    runs: :class:`~gear_mpi.distributed.prefetch.ReplayPrefetch`), so the count stays the same on every rank.
    Args:
        comm: the replay's communicator.
        board: the node board, when every rank is on one node (heads then travel through it); None: MPI.
    Attributes:
        count: heads this rank has sent (its last call's number).
    """

    def __init__(self, comm: MpiComm, board=None):
        self.comm = comm
        self.board = board
        self.count = 0

    def agree(self, error: BaseException | None, what: str, values=(), payload: np.ndarray | None = None):
        """The call ``what``'s head, agreed: every rank's ``values`` (and ``payload``), or the same error everywhere.

        Collective: one allgather of :data:`WIDTH` float64 a rank (none over the node board: a row written,
        a counter published, the peers' counters awaited), plus, with ``payload``, one allgather of it
        posted right behind; 1 KiB a rank more when some rank failed.
        Args:
            error: this rank's exception with the call's arguments, or None.
            what: the call, one of :data:`OPS` (it also names the call in errors).
            values: up to :data:`VALUES` numbers (the same count on every rank).
            payload: a 1-D array of the same size and dtype on every rank making this call, or None.
        Returns:
            float64 ``[ranks, len(values)]``, row r from rank r; with ``payload``, ``(that, [ranks, n] payloads)``.
        Raises:
            CollectiveError: the ranks are in different calls (the same message on every rank, naming each
                rank's call; the replay is then unusable), or an earlier call failed.
            the lowest failing rank's error class (:meth:`MpiComm.agree`), on every rank.
            CollectiveTimeoutError: a rank did not arrive within the deadline.
        """
        comm = self.comm
        comm.check_usable()
        n = len(values)
        self.count += 1
        head = np.zeros(WIDTH, np.float64)
        head[0] = -1.0 if error is None else float(error_code(error))
        head[1] = float(self.count * _SPAN + OPS.index(what))
        head[2:2 + n] = values
        posted = sent = None
        try:
            if self.board is not None:
                round_ = self.board.share(head)
                posted = self._post(payload)
                table = self.board.gather(round_, WIDTH, what)
            else:
                table = np.empty((comm.size, WIDTH), np.float64)
                sent = comm.comm.Iallgather(head, table), (head, table)
                posted = self._post(payload)
                comm.wait(sent[0], what)
        except errors.CollectiveTimeoutError:
            if sent is not None:
                _ABANDONED.append(sent)  # the head is pending too (comm.wait marked the communicator)
            self._abandon(posted)
            raise
        self.check(table, error, what, posted)
        if posted is None:
            return table[:, 2:2 + n]
        return table[:, 2:2 + n], self._finish(posted, what)

    def check(self, table: np.ndarray, error: BaseException | None, what: str, posted=None) -> None:
        """Raise what an agreed head table says, the same on every rank: ranks in different calls, or a rank
        whose arguments failed. Local, O(ranks) (:meth:`agree`'s second half; a repeated sample,
        :mod:`gear_mpi.distributed.repeat`, agrees its head itself and calls this).

        Args:
            table: the agreed heads, ``[ranks, WIDTH]`` float64; error: this rank's error, or None;
            what: the call; posted: a payload posted behind the head (:meth:`agree`), or None.
        Raises:
            CollectiveError, the lowest failing rank's error class: as :meth:`agree`.
        """
        comm = self.comm
        codes = table[:, 1].tolist()  # a few numbers: cheaper in Python than numpy
        if len(set(codes)) > 1:
            message = mismatch_message(codes)
            comm.broken = message
            if posted is not None:
                _ABANDONED.append(posted)
            if payload_pending(codes):  # alike on every rank: a later collective here would meet a payload
                deadline.mark_pending(comm.comm, message)
            raise errors.CollectiveError(message)
        if max(table[:, 0].tolist()) >= 0:  # somebody failed: every rank knows, and all raise its error
            self._finish(posted, what)
            comm.raise_agreed(error, what, table[:, 0])

    def _post(self, payload: np.ndarray | None):
        if payload is None:
            return None
        payload = np.ascontiguousarray(payload)
        out = np.empty((self.comm.size, len(payload)), payload.dtype)
        return self.comm.comm.Iallgather(payload, out), (payload, out)

    def _finish(self, posted, what: str) -> np.ndarray | None:
        if posted is None:
            return None
        try:
            self.comm.wait(posted[0], what)
        except errors.CollectiveTimeoutError:
            _ABANDONED.append(posted)
            raise
        return posted[1][1]

    def _abandon(self, posted) -> None:
        """A payload that may stay pending: keep its buffers alive, and the communicator marked as holding it."""
        if posted is not None:
            _ABANDONED.append(posted)
            deadline.mark_pending(self.comm.comm, self.comm.broken or "a collective's payload was left pending")

"""Deadlines of a checkpoint's long local work: a slow rank is told from an absent one.

A save writes, and a load reads, gigabytes per rank; a deadline of ``timeout``
seconds cannot bound that. So every rank knows, from the first agreement (save)
or the manifest (load), how many bytes every rank has to move, and waits for rank
r until

    ``timeout + bytes[r] / rate``   after the work began, and, while r reports
    progress, until ``timeout`` after its last report,

where ``rate`` is a deliberately low file-system speed (:data:`DEFAULT_RATE`,
10 MB/s; ``GEAR_MPI_CHECKPOINT_RATE`` in MB/s changes it). Progress reports are
heartbeats: each rank tells every other one how many bytes it has moved, at most
every ``min(1 s, timeout / 4)``, as its writes and reads advance, and its exact count
when it is done. Rank 0's progress display (:class:`gear_mpi.progress.Meter`, given to
the channel) shows its own bytes plus those the peers last reported: the whole call's
progress at no extra message. A rank that
misses its deadline is named in the error, with its byte count, as *absent* (no
sign of it since the work began: dead, hung, or not in this call) or *slow* (it
had moved some bytes, then nothing for ``timeout`` s). The rank that gives up
tells the others, so they stop at once too, the late rank included once it
looks up.

All of this runs on :class:`CheckpointComm`, a duplicate of the replay's
communicator made for one save or load: whatever a failed save or load leaves
pending there cannot be matched against the replay's own later collectives, so
the replay's communicator stays usable (a dead rank still fails the next
collective after ``timeout``, as always).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from ..distributed import deadline
from ..distributed.comm import MpiComm
from ..errors import CollectiveTimeoutError
from ..progress import Meter, human, log

DEFAULT_RATE = 10e6  # bytes per second that any file system in use is assumed to reach
RATE_ENV = "GEAR_MPI_CHECKPOINT_RATE"
BEAT, DONE, GAVE_UP = 1, 2, 3
ABSENT, SLOW = 1, 2
_TAG = 0x6E00


def assumed_rate() -> float:
    """The file-system speed deadlines assume, bytes/s: ``GEAR_MPI_CHECKPOINT_RATE`` (MB/s) or 10 MB/s. Local.

    Raises:
        ValueError: the variable is set but not a positive number.
    """
    raw = os.environ.get(RATE_ENV, "").strip()
    if not raw:
        return DEFAULT_RATE
    try:
        rate = float(raw) * 1e6
    except ValueError:
        rate = -1.0
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"{RATE_ENV}={raw!r}: must be a positive number of MB/s")
    return rate


class CheckpointComm(MpiComm):
    """A duplicate of ``parent``'s communicator for one save or load, with the same ``timeout``.

    While a :class:`Channel` is open on it, every wait also listens to it, so a peer
    that gave up ends the wait at once. Close it with :meth:`close`.
    Args:
        parent: the replay's (or the load's) MpiComm.
        what: names the call in errors.
    Raises:
        CollectiveTimeoutError: a rank did not join the duplication within ``timeout``.
    Cost: one ``Idup`` (a collective) with the deadline.
    """

    def __init__(self, parent: MpiComm, what: str):
        parent.check_usable()
        dup, req = parent.comm.Idup()
        parent.wait(req, what)
        super().__init__(dup, parent.timeout)
        self.channel: Channel | None = None
        self._tags = 0

    def next_tag(self) -> int:
        """A message tag no earlier channel of this communicator used. Local."""
        self._tags += 1
        return _TAG + self._tags

    def wait(self, req, what: str) -> None:
        """As :meth:`MpiComm.wait`, also raising at once when a peer gave up (see :class:`Channel`).

        Args:
            req: an mpi4py request.
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``, or a peer gave up.
        """
        channel = self.channel
        if channel is None:
            return super().wait(req, what)

        def test() -> bool:
            channel.poll()
            return req.Test()
        return super().wait(_Tested(test), what)

    def close(self) -> None:
        """Close the open channel (cancelling its receives) and free the duplicate. Local; idempotent."""
        if self.channel is not None:
            self.channel.close()
        self.free()


class _Tested:
    def __init__(self, test):
        self.Test = test


class Channel:
    """Heartbeats, arrivals and give-ups of one phase of local work (point to point, on a CheckpointComm).

    Args:
        comm: the checkpoint's communicator; the channel becomes its open one.
        what: names the call in errors (``"save"``, ``"load"``).
        nbytes: bytes each rank has to move in this phase (the same on every rank).
        verb: ``"write"`` or ``"read"``, for the messages.
        meter: the phase's :class:`~gear_mpi.progress.Meter` (None: none): its advances are this
            rank's heartbeats (counted from the bytes it had when the channel opened), and what the
            peers report becomes its ``peers`` count (on top of what they had reported before).
            A meter that shows progress also takes in the peers' reports at each heartbeat.
    Raises:
        ValueError: ``GEAR_MPI_CHECKPOINT_RATE`` is not a positive number.
    Cost: one receive posted per peer; each heartbeat is one 24-byte send per peer.
    """

    def __init__(self, comm: CheckpointComm, what: str, nbytes, verb: str, meter: Meter | None = None):
        self.comm, self.what, self.verb = comm, what, verb
        self.mpi, self.rank, self.timeout = comm.comm, comm.rank, comm.timeout
        self.nbytes = np.asarray(nbytes, np.float64)
        self.rate = assumed_rate()
        self.tag = comm.next_tag()
        self.peers = [p for p in range(comm.size) if p != comm.rank]
        self.bufs = {p: np.zeros(3, np.int64) for p in self.peers}
        self.recvs = {p: self.mpi.Irecv(self.bufs[p], source=p, tag=self.tag) for p in self.peers}
        self.heard: dict[int, float] = {}
        self.moved = {p: 0 for p in self.peers}
        self.arrived: set[int] = set()
        self.sends: list = []
        self.beat_every = min(1.0, self.timeout / 4)
        self.last_beat = -math.inf
        self.start = time.monotonic()
        self.mine = 0  # bytes this rank moved in this phase
        self.gave_up: CollectiveTimeoutError | None = None  # a peer's give-up, taken in but not yet raised
        self.meter = meter
        if meter is not None:
            self.local_base, self.peer_base = meter.done, meter.peers
            meter.listeners.append(self.beat)
        comm.channel = self

    def allowed(self, p: int) -> float:
        """Seconds after the start that rank ``p`` may take without reporting progress. Local, O(1)."""
        return self.timeout + float(self.nbytes[p]) / self.rate

    def _send(self, kind: int, a: int = 0, b: int = 0) -> None:
        msg = np.array([kind, a, b], np.int64)
        self.sends = [s for s in self.sends if not s[0].Test()]
        for p in self.peers:
            self.sends.append((self.mpi.Isend(msg, dest=p, tag=self.tag), msg))

    def beat(self, moved: int) -> None:
        """Tell the peers this rank has moved ``moved`` bytes (at most every ``min(1 s, timeout/4)``). Local.

        Args:
            moved: bytes moved so far (with a meter: the meter's count, of which this phase's part is sent).
        """
        if self.meter is not None:
            moved -= self.local_base
        self.mine = int(moved)
        now = time.monotonic()
        if now - self.last_beat >= self.beat_every and self.peers:
            self.last_beat = now
            self._send(BEAT, self.mine)
            if self.meter is not None and self.meter.show:
                self._take()  # the peers' reports, for the display (a give-up is raised at the next poll)

    def poll(self) -> None:
        """Take in what the peers sent. Local.

        Raises:
            CollectiveTimeoutError: a peer gave up waiting (for this rank or another).
        """
        self._take()
        if self.gave_up is not None:
            raise self.gave_up

    def _take(self) -> None:
        """Take in the peers' messages (a give-up is kept in ``gave_up``); update the meter's peers count."""
        heard = False
        for p in self.peers:
            while self.recvs[p] is not None and self.recvs[p].Test():
                kind, a, b = (int(v) for v in self.bufs[p])
                self.recvs[p] = self.mpi.Irecv(self.bufs[p], source=p, tag=self.tag)
                if kind == BEAT:
                    self.heard[p], self.moved[p] = time.monotonic(), a
                    heard = True
                elif kind == DONE:
                    self.arrived.add(p)
                    self.moved[p] = a
                    heard = True
                elif kind == GAVE_UP and self.gave_up is None:
                    whom = "this rank" if a == self.rank else f"rank {a}"
                    self.gave_up = CollectiveTimeoutError(
                        f"{self.what}: rank {p} gave up waiting for {whom} (found it "
                        f"{'absent' if b == ABSENT else 'slow'}; rank {p}'s error says more); nothing was "
                        f"{'installed' if self.what == 'save' else 'loaded'}, and the replay's communicator stays "
                        f"usable")
        if heard and self.meter is not None:
            self.meter.report_peers(self.peer_base + sum(self.moved.values()))

    def arrive(self) -> None:
        """Tell the peers this rank's work of the phase is over (done or failed), with its byte count. Local."""
        self._send(DONE, self.mine)

    def await_peers(self) -> None:
        """Wait until every peer has arrived, each within its own deadline (see the module docstring).

        Raises:
            CollectiveTimeoutError: a peer missed its deadline (named, absent or slow, with its byte
                count; the other ranks are told), or a peer gave up.
        """
        while True:
            self.poll()  # first what was sent meanwhile: this rank may be the late one
            now = time.monotonic()
            missing = [p for p in self.peers if p not in self.arrived]
            if not missing:
                return
            due = {p: max(self.start + self.allowed(p), self.heard.get(p, -math.inf) + self.timeout)
                   for p in missing}
            late = [p for p in missing if now > due[p]]
            if late:
                self._give_up(late[0], now)
            deadline.poll(self._all_arrived, min(due.values()) - now + 1e-3)

    def finish(self, err: BaseException | None, what: str) -> None:
        """End the phase: arrive, wait for every peer within its deadline, agree on ``err``, close.

        Args:
            err: this rank's error of the phase, or None.
            what: names the call in an agreed error.
        Raises:
            CollectiveTimeoutError: a peer missed its deadline (see :meth:`await_peers`).
            The lowest failing rank's error, on every rank (``MpiComm.agree``).
        """
        self.arrive()
        self.await_peers()
        self.comm.agree(err, what)
        self.close()

    def _all_arrived(self) -> bool:
        self.poll()
        return len(self.arrived) == len(self.peers)

    def _give_up(self, p: int, now: float) -> None:
        absent = p not in self.heard
        self._send(GAVE_UP, p, ABSENT if absent else SLOW)
        allowed = (f"allowed: timeout={self.timeout:g} s + {human(self.nbytes[p])} at "
                   f"{self.rate / 1e6:g} MB/s = {self.allowed(p):.1f} s, or timeout={self.timeout:g} s after "
                   f"its last progress report")
        if absent:
            why = (f"rank {p} is absent: no sign of it {now - self.start:.1f} s after the {self.what} began, with "
                   f"{human(self.nbytes[p])} to {self.verb} ({allowed}); it is dead, hung, or not in this call")
        else:
            why = (f"rank {p} is slow: it had to {self.verb} {human(self.nbytes[p])}, reported "
                   f"{human(self.moved[p])} done, then nothing for {now - self.heard[p]:.1f} s ({allowed}; set "
                   f"GEAR_MPI_CHECKPOINT_RATE lower, in MB/s, for a slower file system)")
        msg = (f"{self.what}: {why}. This is rank {self.rank}; nothing was "
               f"{'installed' if self.what == 'save' else 'loaded'}, and the replay's communicator stays usable")
        log.warning("%s", msg)
        raise CollectiveTimeoutError(msg)

    def close(self) -> None:
        """Cancel the receives still posted; stop being the communicator's open channel. Local; idempotent."""
        for p, req in self.recvs.items():
            if req is not None:
                try:
                    req.Cancel()
                    req.Wait()
                except Exception:
                    pass
                self.recvs[p] = None
        self.sends = [s for s in self.sends if not s[0].Test()]
        if self.comm.channel is self:
            self.comm.channel = None
        if self.meter is not None and self.beat in self.meter.listeners:
            self.meter.listeners.remove(self.beat)

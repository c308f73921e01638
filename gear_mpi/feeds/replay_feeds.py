"""How data reaches a Replay from outside its ranks, and how fast: writers, actor ranks, the rate limiter.

:class:`ReplayFeeds` is a mixin of :class:`~gear_mpi.replay.Replay`. It owns the
rank's :class:`~gear_mpi.feeds.intake.WriterIntake` (local writers, made on the first
:meth:`~ReplayFeeds.writer_address`), its :class:`~gear_mpi.feeds.remote.RemoteInbox`
objects (actor ranks, after :meth:`~ReplayFeeds.accept_remote`) and the
:mod:`gear_mpi.feeds.rate_limit` rule. Ended episodes enter the shard at the rank's
collectives (``sample``, ``update_priorities``, ``stats``) and at :meth:`~ReplayFeeds.ingest`,
but only within the rank's *insert budget*: the replay's global budget (from the
counts every ``sample`` header carries) split over the ranks by their backlog
(:func:`split_budget`), so the writers of a rank that runs ahead block on full
staging areas.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..errors import RateLimitTimeoutError
from .intake import WriterIntake
from ..kernels import ring
from ..distributed.plans import BACKLOG, BATCH, INSERTED, ITEMS, SAMPLED, WAITED
from .rate_limit import RateLimiter
from .remote import RemoteInbox


def split_budget(total: float, backlog: np.ndarray) -> np.ndarray:
    """Deal a global insert budget to the ranks: a fair share each, capped by its backlog, then what is left
    to ranks with backlog in rank order, then the rest evenly. The same on every rank (it sees the same table).

    Args:
        total: items the replay may still insert (``inf``: no limit).
        backlog: each rank's episodes waiting in its writers.
    Returns:
        float64 budget per rank (summing to at most ``total``).
    """
    p = len(backlog)
    if math.isinf(total):
        return np.full(p, math.inf)
    total = int(total)
    want = np.maximum(backlog.astype(np.int64), 0)
    alloc = np.minimum(want, total // p)
    left = total - int(alloc.sum())
    for r in range(p):
        extra = min(int(want[r] - alloc[r]), left)
        alloc[r] += extra
        left -= extra
    alloc += left // p
    alloc[:left % p] += 1
    return alloc.astype(np.float64)


class ReplayFeeds:
    """Writers, actor ranks and the rate limiter of a Replay (mixed in; see the module docstring)."""

    def _init_feeds(self, rate_limiter: RateLimiter | None, rate_limit_timeout: float) -> None:
        if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
            raise TypeError(f"rate_limiter must be a gear_mpi rate limiter (MinSize(n), SampleToInsertRatio(...)) or "
                            f"None, got {rate_limiter!r}")
        if not (isinstance(rate_limit_timeout, (int, float)) and rate_limit_timeout > 0):
            raise ValueError(f"rate_limit_timeout must be a positive number of seconds, got {rate_limit_timeout!r}")
        self.rate_limiter = rate_limiter
        self.rate_limit_timeout = float(rate_limit_timeout)
        self._ingest_point: WriterIntake | None = None
        self._inboxes: list[RemoteInbox] = []
        # until the first sample header, each rank may insert its share of an empty replay's budget
        self._budget = math.inf if rate_limiter is None else \
            float(split_budget(rate_limiter.insert_budget(0, 0, 0), np.zeros(self.ranks))[self.rank])

    # ---- the public side --------------------------------------------------------------------
    def writer_address(self) -> str:
        """This rank's ingest point, for :class:`gear_mpi.Writer` processes on this node (local).

        Returns:
            A string, valid while the replay is open (the name of a small shared-memory segment, made
            on the first call).
        Raises:
            RuntimeError: the replay is closed.
        Cost: the first call makes a 64 KiB segment; later calls O(1).
        """
        self._check_open()
        if self._ingest_point is None:
            self._ingest_point = WriterIntake(self.shard)
        return self._ingest_point.address

    def accept_remote(self, comm) -> None:
        """Take episodes from :class:`gear_mpi.MpiWriter` actor ranks of ``comm`` from now on (local).

        Args:
            comm: an mpi4py communicator holding this rank and its actors (e.g. ``MPI.COMM_WORLD``).
        Raises:
            RuntimeError: the replay is closed. TypeError: not a communicator.
        """
        self._check_open()
        if not hasattr(comm, "Iprobe"):
            raise TypeError(f"accept_remote needs an mpi4py communicator, got {comm!r}")
        self._inboxes.append(RemoteInbox(comm, self.shard))

    def ingest(self) -> int:
        """Move the writers' and actor ranks' ended episodes into this rank's shard now (local), within
        the rate limiter's insert budget.

        Returns:
            How many trajectories entered.
        Raises:
            CollectiveTimeoutError: a node peer never finished reading the last sample (node fence).
        Cost: O(writers) counter reads; per writer with episodes, one copy of them into the shard.
        """
        self._check_open()
        return self._feed()

    # ---- used by Replay ----------------------------------------------------------------------
    def _feed(self) -> int:
        """Drain within the budget (the node fence first, only when something is waiting)."""
        if self._ingest_point is None and not self._inboxes:
            return 0
        if self._budget < 1 or not self._backlog():
            return 0
        self.settle()
        n = 0
        for source in ([self._ingest_point] if self._ingest_point else []) + self._inboxes:
            n += source.drain(self._budget - n)
        if not math.isinf(self._budget):
            self._budget -= n
        return n

    def _backlog(self) -> int:
        n = self._ingest_point.backlog() if self._ingest_point is not None else 0
        return n + sum(box.backlog() for box in self._inboxes)

    def _feed_columns(self, waited: float) -> list[float]:
        """This rank's rate-limiter columns of a sample header: inserted, sampled, backlog, waited."""
        s = self.shard
        backlog = self._backlog() if self.rate_limiter is not None and (self._ingest_point or self._inboxes) else 0
        return [float(s.store.state[ring.INSERTED_TOTAL]), float(s.samples_drawn), float(backlog), waited]

    def _admit(self, head: np.ndarray) -> bool:
        """Decide from the agreed header (the same on every rank) whether this sample runs now; set this
        rank's insert budget.

        Raises:
            ValueError: the call is larger than the limiter's band (it could never run).
            RateLimitTimeoutError: a rank has waited longer than ``rate_limit_timeout``.
        """
        lim = self.rate_limiter
        if lim is None:
            return True
        inserted, sampled = int(head[:, INSERTED].sum()), int(head[:, SAMPLED].sum())
        size, n = int(head[:, ITEMS].sum()), int(head[:, BATCH].sum())
        lim.check_call(n)
        budget = split_budget(lim.insert_budget(inserted, sampled, size), head[:, BACKLOG])
        self._budget = float(budget[self.rank if len(head) > 1 else 0])
        if n == 0 or lim.can_sample(inserted, sampled, size, n):
            return True
        waited = float(head[:, WAITED].max())
        if waited > self.rate_limit_timeout:
            raise RateLimitTimeoutError(
                f"sample: the rate limiter {lim!r} held this sample for {waited:.1f} s > rate_limit_timeout="
                f"{self.rate_limit_timeout:g} s (replay: {inserted} items inserted, {sampled} windows sampled, "
                f"{size} live; the call asks for {n} windows): feed it faster, or sample less")
        return False

    def _agree_header(self, err, batch_size: int, window: int, code: int, mcode: int, local: bool = False):
        """The sample's agreed header once the rate limiter admits the call; each waiting round drains the
        writers, backs off and agrees again (every rank decides alike: :meth:`ReplayFeeds._admit`)."""
        start, rounds = time.monotonic(), 0
        while True:
            try:
                self._feed()
            except Exception as e:  # agreed below, so every rank raises it
                err = err or e
            sh = self.shard
            row = [batch_size, window, code, sh.total_weight, len(sh), sh.min_weight, mcode]
            row += self._feed_columns(time.monotonic() - start)
            if local:
                if err is not None:
                    raise err
                head = np.array(row, np.float64)[None]
            else:
                head = (self.node.board or self.comm).agree(err, "sample", row)  # node board: no MPI
            if self._admit(head):
                return head
            self._back_off(rounds)
            rounds += 1

    @staticmethod
    def _back_off(rounds: int) -> None:
        time.sleep(min(1e-4 * (2 ** min(rounds, 10)), 0.02))

    def _close_feeds(self) -> None:
        for box in self._inboxes:
            box.close()
        self._inboxes = []
        if self._ingest_point is not None:
            self._ingest_point.close()
            self._ingest_point = None

    def _feed_stats(self) -> dict[str, int]:
        """This rank's feed figures for ``stats()``."""
        ip = self._ingest_point
        return {"ingested": (ip.ingested if ip else 0) + sum(b.ingested for b in self._inboxes),
                "writers": (len(ip.writers) if ip else 0) + sum(len(b.actors) for b in self._inboxes),
                "staged": self._backlog() if (ip or self._inboxes) else 0}

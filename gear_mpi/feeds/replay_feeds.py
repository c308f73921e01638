"""How data reaches a Replay from outside its ranks, and how fast: writers, actor ranks, the rate limiter.

:class:`ReplayFeeds` is the part of a :class:`~gear_mpi.replay.Replay` that owns the rank's
:class:`~gear_mpi.feeds.intake.WriterIntake` (local writers, made on the first
:meth:`~ReplayFeeds.writer_address`), its :class:`~gear_mpi.feeds.remote.RemoteInbox`
objects (actor ranks, after :meth:`~ReplayFeeds.accept_remote`) and the
:mod:`gear_mpi.feeds.rate_limit` rule. Ended episodes enter the shard at the rank's
collectives (``sample``, ``update_priorities``, ``stats``) and at ``Replay.ingest``
(:meth:`~ReplayFeeds.feed`), but only within the rank's *insert budget*: the replay's global
budget (from the counts every sample header carries, :mod:`gear_mpi.distributed.header`) split
over the ranks by their backlog (:func:`split_budget`), so the writers of a rank that runs ahead
block on full staging areas. :meth:`~ReplayFeeds.admit` reads the agreed header and says whether
a sample runs now (the header's agreement loops on it: :func:`gear_mpi.distributed.header.agree`).
Everything here is local.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from ..errors import RateLimitTimeoutError
from .intake import WriterIntake
from ..distributed.header import BACKLOG, BATCH, INSERTED, ITEMS, SAMPLED, WAITED
from .rate_limit import RateLimiter
from .remote import RemoteInbox


def check_rate_limit(rate_limiter: RateLimiter | None, rate_limit_timeout: float) -> None:
    """Check a Replay's rate-limiter arguments (local, O(1)).

    Raises:
        TypeError: ``rate_limiter`` is not a gear_mpi rate limiter (nor None).
        ValueError: ``rate_limit_timeout`` is not a positive number.
    """
    if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
        raise TypeError(f"rate_limiter must be a gear_mpi rate limiter (MinSize(n), SampleToInsertRatio(...)) or "
                        f"None, got {rate_limiter!r}")
    if not (isinstance(rate_limit_timeout, (int, float)) and rate_limit_timeout > 0):
        raise ValueError(f"rate_limit_timeout must be a positive number of seconds, got {rate_limit_timeout!r}")


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
    """Writers, actor ranks and the rate limiter of one rank of a Replay (see the module docstring). Local.

    Args:
        shard: this rank's shard, which the episodes enter.
        rank, ranks: this rank and the replay's rank count (to split the insert budget).
        settle: the replay's node fence (``Replay.settle``), called before episodes are written into the shard.
        rate_limiter, rate_limit_timeout: as ``Replay`` takes them (checked: :func:`check_rate_limit`).
    """

    def __init__(self, shard, rank: int, ranks: int, settle: Callable[[], None], rate_limiter: RateLimiter | None,
                 rate_limit_timeout: float):
        check_rate_limit(rate_limiter, rate_limit_timeout)
        self.shard, self.rank, self.settle = shard, rank, settle
        self.rate_limiter = rate_limiter
        self.rate_limit_timeout = float(rate_limit_timeout)
        self.intake: WriterIntake | None = None
        self.inboxes: list[RemoteInbox] = []
        # until the first sample header, each rank may insert its share of an empty replay's budget
        self.budget = math.inf if rate_limiter is None else \
            float(split_budget(rate_limiter.insert_budget(0, 0, 0), np.zeros(ranks))[rank])

    @property
    def idle(self) -> bool:
        """No rate limiter, no writers and no actor ranks: nothing for a sample header to carry (O(1))."""
        return self.rate_limiter is None and self.intake is None and not self.inboxes

    def writer_address(self) -> str:
        """This rank's ingest point (made on the first call: a 64 KiB shared-memory segment); see
        ``Replay.writer_address``."""
        if self.intake is None:
            self.intake = WriterIntake(self.shard)
        return self.intake.address

    def accept_remote(self, comm) -> None:
        """Take episodes from the actor ranks of ``comm`` from now on; see ``Replay.accept_remote``.

        Raises:
            TypeError: not a communicator.
        """
        if not hasattr(comm, "Iprobe"):
            raise TypeError(f"accept_remote needs an mpi4py communicator, got {comm!r}")
        self.inboxes.append(RemoteInbox(comm, self.shard))

    def feed(self) -> int:
        """Drain the writers and actor ranks into the shard within the insert budget (the node fence first,
        only when something is waiting). Returns how many trajectories entered.

        Raises:
            CollectiveTimeoutError: a node peer never finished reading the last sample (node fence).
        Cost: O(writers) counter reads; per writer with episodes, one copy of them into the shard.
        """
        if self.intake is None and not self.inboxes:
            return 0
        if self.budget < 1 or not self.backlog():
            return 0
        self.settle()
        n = 0
        for source in ([self.intake] if self.intake else []) + self.inboxes:
            n += source.drain(self.budget - n)
        if not math.isinf(self.budget):
            self.budget -= n
        return n

    def backlog(self) -> int:
        """Episodes waiting in this rank's writers and inboxes (O(writers))."""
        n = self.intake.backlog() if self.intake is not None else 0
        return n + sum(box.backlog() for box in self.inboxes)

    def header_backlog(self) -> int:
        """The header's ``BACKLOG`` column: :meth:`backlog` with a rate limiter and something to drain, else 0."""
        return self.backlog() if self.rate_limiter is not None and (self.intake or self.inboxes) else 0

    def admit(self, head: np.ndarray) -> bool:
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
        self.budget = float(budget[self.rank if len(head) > 1 else 0])
        if n == 0 or lim.can_sample(inserted, sampled, size, n):
            return True
        waited = float(head[:, WAITED].max())
        if waited > self.rate_limit_timeout:
            raise RateLimitTimeoutError(
                f"sample: the rate limiter {lim!r} held this sample for {waited:.1f} s > rate_limit_timeout="
                f"{self.rate_limit_timeout:g} s (replay: {inserted} items inserted, {sampled} windows sampled, "
                f"{size} live; the call asks for {n} windows): feed it faster, or sample less")
        return False

    @staticmethod
    def back_off(rounds: int) -> None:
        """Sleep before the next header round (exponential, at most 20 ms)."""
        time.sleep(min(1e-4 * (2 ** min(rounds, 10)), 0.02))

    def figures(self) -> dict[str, int]:
        """This rank's feed figures for ``stats()``: ``ingested``, ``writers``, ``staged``."""
        ip = self.intake
        return {"ingested": (ip.ingested if ip else 0) + sum(b.ingested for b in self.inboxes),
                "writers": (len(ip.writers) if ip else 0) + sum(len(b.actors) for b in self.inboxes),
                "staged": self.backlog() if (ip or self.inboxes) else 0}

    def close(self) -> None:
        """Close the inboxes and the ingest point (local; idempotent)."""
        for box in self.inboxes:
            box.close()
        self.inboxes = []
        if self.intake is not None:
            self.intake.close()
            self.intake = None

"""How data reaches a Replay from outside its ranks, and how fast: writers, actor ranks, the rate limiter.

:class:`ReplayFeeds` is the part of a :class:`~gear_mpi.replay.Replay` that owns the rank's
:class:`~gear_mpi.feeds.intake.WriterIntake` (local writers, made on the first
:meth:`~ReplayFeeds.writer_address`), its :class:`~gear_mpi.feeds.remote.RemoteInbox`
objects (actor ranks, after :meth:`~ReplayFeeds.accept_remote`) and the
:mod:`gear_mpi.feeds.rate_limit` rule. Ended episodes enter the shard at the rank's
collectives (``sample``, ``update_priorities``, ``stats``) and at ``Replay.ingest``
(:meth:`~ReplayFeeds.feed`), but only within the rank's *insert budget*: the replay's global
budget (from the counts every sample header carries, :mod:`gear_mpi.distributed.header`) split
over the ranks by their backlog (:func:`split_budget`). :meth:`~ReplayFeeds.admit` reads the agreed
header and says whether a sample runs now (the header's agreement loops on it:
:func:`gear_mpi.distributed.header.agree`).

**The hold** (backpressure from the limiter to the actors). Draining only within the budget
is not enough: an actor that runs flat out would pile ended episodes up in its staging area
(thousands, many seconds old, thrown away at close). So after every drain and every admitted
or refused sample the rank publishes in its registry how many ended episodes each of its live
writers may have staged: ``ceil((allowance + slack) / live writers)``, at least 1, where the
allowance is what is left of the rank's insert budget and the slack is ``Replay(writer_slack=)``,
by default the items of two of the largest sample calls so far, per rank
(``2 * ceil(windows / samples_per_insert / ranks)``; 1 before the first call). A writer with that
many waits in ``end_episode`` (:mod:`gear_mpi.feeds.writer`). So a rank's local writers stage at
most its allowance + slack + (live writers - 1) episodes -- when the actors outrun the learner the
allowance is about one call's items, since each admitted call lets in what it sampled -- and the
newest ingested step is about ``(slack + writers) / (the rank's ingest rate)`` seconds old. A
larger slack rides out actors' jitter (episode resets, slow steps) at the cost of older data.
Without a rate limiter, or with one that never limits inserts (``MinSize``: ``max_diff``
infinite), there is no hold: only a full staging area blocks a writer. Actor ranks
(``MpiWriter``) are bounded by their ``max_in_flight`` instead. Everything here is local.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from ..distributed.comm import check_timeout
from ..errors import RateLimitTimeoutError
from .intake import WriterIntake
from ..distributed.header import BACKLOG, BATCH, INSERTED, ITEMS, SAMPLED, WAITED
from .rate_limit import RateLimiter
from .remote import RemoteInbox


def check_rate_limit(rate_limiter: RateLimiter | None, rate_limit_timeout: float,
                     writer_slack: int | None = None) -> None:
    """Check a Replay's rate-limiter arguments (local, O(1)).

    Raises:
        TypeError: ``rate_limiter`` is not a gear_mpi rate limiter (nor None).
        ValueError: ``rate_limit_timeout`` is not a positive number, or ``writer_slack`` not None nor an
            integer >= 0.
    """
    if writer_slack is not None and (isinstance(writer_slack, bool) or not isinstance(writer_slack, (int, np.integer))
                                     or writer_slack < 0):
        raise ValueError(f"writer_slack must be None or an integer >= 0 (episodes), got {writer_slack!r}")
    if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
        raise TypeError(f"rate_limiter must be a gear_mpi rate limiter (MinSize(n), SampleToInsertRatio(...)) or "
                        f"None, got {rate_limiter!r}")
    check_timeout(rate_limit_timeout, "rate_limit_timeout")


def _revoked(comm) -> bool:
    """Whether an mpi4py communicator was revoked (ULFM); False where that cannot be asked."""
    try:
        return bool(comm.Is_revoked())
    except Exception:
        return False


_UNBOUNDED = 2 ** 62  # a budget or hold cap this large is no limit (and would not fit the int64 counters)


def split_budget(total: float, backlog: np.ndarray) -> np.ndarray:
    """Deal a global insert budget to the ranks: a fair share each, capped by its backlog, then what is left
    to ranks with backlog in rank order, then the rest evenly. The same on every rank (it sees the same table).

    Args:
        total: items the replay may still insert (``inf``, or ``_UNBOUNDED`` and more: no limit).
        backlog: each rank's episodes waiting in its writers.
    Returns:
        float64 budget per rank (summing to at most ``total``).
    """
    p = len(backlog)
    if total >= _UNBOUNDED:  # a band of 1e300 windows: int64 could not hold its shares
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
        rate_limiter, rate_limit_timeout, writer_slack: as ``Replay`` takes them (checked:
            :func:`check_rate_limit`).
    """

    def __init__(self, shard, rank: int, ranks: int, settle: Callable[[], None], rate_limiter: RateLimiter | None,
                 rate_limit_timeout: float, writer_slack: int | None = None):
        check_rate_limit(rate_limiter, rate_limit_timeout, writer_slack)
        self.shard, self.rank, self.settle = shard, rank, settle
        self.rate_limiter = rate_limiter
        self.rate_limit_timeout = float(rate_limit_timeout)
        self.intake: WriterIntake | None = None
        self.inboxes: list[RemoteInbox] = []
        # until the first sample header, each rank may insert its share of an empty replay's budget
        self.budget = math.inf if rate_limiter is None else \
            float(split_budget(rate_limiter.insert_budget(0, 0, 0), np.zeros(ranks))[rank])
        # the hold: only under a limiter that bounds inserts
        self.holds = rate_limiter is not None and not math.isinf(rate_limiter.max_diff)
        self.writer_slack = None if writer_slack is None else int(writer_slack)
        self._call_items = 0  # items per rank of the largest sample call admitted so far
        self._staged = 0  # this rank's backlog as last counted (read by gauges() from any thread)

    @property
    def idle(self) -> bool:
        """No rate limiter, no writers and no actor ranks: nothing for a sample header to carry (O(1))."""
        return self.rate_limiter is None and self.intake is None and not self.inboxes

    def writer_address(self) -> str:
        """This rank's ingest point (made on the first call: a 64 KiB shared-memory segment); see
        ``Replay.writer_address``."""
        if self.intake is None:
            self.intake = WriterIntake(self.shard)
            self.hold()
        return self.intake.address

    def adopt(self, other: "ReplayFeeds") -> str | None:
        """Take ``other``'s ingest point, its writers and the episodes they staged, and its actor ranks'
        inboxes, so that they go on into this rank's shard (the writers under the same address)
        (``Replay.recover``: the survivors' new replay takes over the old one's writers and actor ranks). An
        inbox on a revoked communicator (the old replay's own) is left to ``other``, which closes it. Local,
        O(inboxes); ``other`` no longer has an ingest point nor those inboxes.

        Returns:
            The address taken over, or None when ``other`` had none.
        Raises:
            ValueError: this one already has an ingest point or inboxes, or the two shards' specs differ
                (nothing taken).
        """
        if other.intake is None and not other.inboxes:
            return None
        if self.intake is not None or self.inboxes:
            raise ValueError("adopt: this replay already has an ingest point (writer_address was called) or "
                             "actor ranks (accept_remote)")
        if other.shard.spec.to_dict() != self.shard.spec.to_dict():
            raise ValueError("adopt: the writers' spec differs from this replay's")
        keep = [box for box in other.inboxes if not _revoked(box.comm)]
        other.inboxes = [box for box in other.inboxes if box not in keep]
        for box in keep:
            box.shard = self.shard
        self.inboxes = keep
        if other.intake is None:
            return None
        self.intake, other.intake = other.intake, None
        self.intake.shard = self.shard
        self.hold()
        return self.intake.address

    @property
    def slack(self) -> int | None:
        """Episodes this rank's writers may stage beyond its insert allowance (module docstring); None: no hold."""
        if not self.holds:
            return None
        if self.writer_slack is not None:
            return self.writer_slack
        return max(1, 2 * math.ceil(self._call_items - 1e-9))

    def hold(self) -> None:
        """Publish the cap on each local writer's staged episodes (see the module docstring; nothing without a
        hold). O(1): one store in the registry."""
        ip = self.intake
        if ip is None or not self.holds:
            return
        allowance = max(self.budget, 0.0)
        if math.isinf(allowance):
            ip.registry.set_hold(0)
            return
        ip.registry.set_hold(min(max(1, math.ceil((allowance + self.slack) / max(ip.live, 1))), _UNBOUNDED))

    def accept_remote(self, comm, timeout: float = 60.0) -> None:
        """Take episodes from the actor ranks of ``comm`` from now on; see ``Replay.accept_remote``.
        ``timeout``: seconds the inbox's close waits for the actors' goodbyes (the replay's deadline).

        Raises:
            TypeError: not a communicator.
        """
        if not hasattr(comm, "Iprobe"):
            raise TypeError(f"accept_remote needs an mpi4py communicator, got {comm!r}")
        self.inboxes.append(RemoteInbox(comm, self.shard, timeout))

    def feed(self) -> int:
        """Drain the writers and actor ranks into the shard within the insert budget (the node fence first,
        only when something is waiting). Returns how many trajectories entered.

        Raises:
            CollectiveTimeoutError: a node peer never finished reading the last sample (node fence).
        Cost: O(writers) counter reads; per writer with episodes, one copy of them into the shard.
        """
        if self.intake is None and not self.inboxes:
            return 0
        n = 0
        if self.budget >= 1 and self.backlog():
            self.settle()
            for source in ([self.intake] if self.intake else []) + self.inboxes:
                n += source.drain(self.budget - n)
            if not math.isinf(self.budget):
                self.budget -= n
            self._staged = max(self._staged - n, 0)
        self.hold()
        return n

    def backlog(self) -> int:
        """Episodes waiting in this rank's writers and inboxes (O(writers))."""
        n = self.intake.backlog() if self.intake is not None else 0
        self._staged = n + sum(box.backlog() for box in self.inboxes)
        return self._staged

    def header_backlog(self) -> int:
        """The header's ``BACKLOG`` column: :meth:`backlog` with a rate limiter and something to drain, else 0."""
        return self.backlog() if self.rate_limiter is not None and (self.intake or self.inboxes) else 0

    def admit(self, head: np.ndarray) -> bool:
        """Decide from the agreed header (the same on every rank) whether this sample runs now; set this
        rank's insert budget.

        Raises:
            ValueError: the call is larger than the limiter's band, or the replay cannot hold the limiter's
                ``min_size_to_sample`` items (it could never run).
            RateLimitTimeoutError: a rank has waited longer than ``rate_limit_timeout``.
        """
        lim = self.rate_limiter
        if lim is None:
            return True
        inserted, sampled = int(head[:, INSERTED].sum()), int(head[:, SAMPLED].sum())
        size, n = int(head[:, ITEMS].sum()), int(head[:, BATCH].sum())
        lim.check_call(n)
        most = self.shard.store.max_items * len(head)  # max_items is the same on every rank (agreed at construction)
        if n and size < lim.min_size_to_sample and most < lim.min_size_to_sample:
            raise ValueError(f"sample: the rate limiter {lim!r} waits for {lim.min_size_to_sample} live items, but the "
                             f"replay holds at most {most} ({len(head)} ranks of max_items="
                             f"{self.shard.store.max_items}): no sample could ever run; lower min_size_to_sample or "
                             f"raise max_items")
        budget = split_budget(lim.insert_budget(inserted, sampled, size), head[:, BACKLOG])
        self.budget = float(budget[self.rank if len(head) > 1 else 0])
        self._call_items = max(self._call_items, n / lim.samples_per_insert / len(head))
        self.hold()
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

    def figures(self) -> dict[str, float]:
        """This rank's feed figures for ``stats()`` (O(writers)): ``ingested``; ``writers`` (live local writers and
        actor ranks) and ``writers_draining`` (local writers that closed or died, with episodes still to ingest);
        ``staged`` (episodes ended and not ingested, actor ranks' included) and ``staged_steps`` (local writers'
        steps of them); ``ingested_age`` (seconds since the newest episode ingested from a local writer ended;
        ``inf`` before any)."""
        ip = self.intake
        mine = ip.figures() if ip else {"writers": 0, "writers_draining": 0, "staged": 0, "staged_steps": 0,
                                        "ingested_age": math.inf}
        mine["ingested"] = (ip.ingested if ip else 0) + sum(b.ingested for b in self.inboxes)
        mine["writers"] += sum(len(b.actors) for b in self.inboxes)
        mine["staged"] += sum(box.backlog() for box in self.inboxes)
        self._staged = mine["staged"]
        return mine

    def gauges(self) -> list[float]:
        """``[staged, staged_steps, ingested_age]`` as last counted at this rank's collectives (for the activity
        counters of :mod:`gear_mpi.stats`; O(1), safe from any thread: it only reads numbers)."""
        ip = self.intake
        return [float(max(self._staged, 0)), float(ip.staged_steps if ip else 0), ip.age() if ip else math.inf]

    def close(self) -> None:
        """Close the inboxes and the ingest point (local; idempotent)."""
        for box in self.inboxes:
            box.close()
        self.inboxes = []
        if self.intake is not None:
            self.intake.close()
            self.intake = None

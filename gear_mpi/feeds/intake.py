"""The owner's side of the writers: finding them, draining their ended episodes into the shard.

An :class:`WriterIntake` is made by a rank on the first ``replay.writer_address()``;
it owns the registry segment (:mod:`gear_mpi.feeds.staging`). :meth:`WriterIntake.drain`
attaches newly announced writers, reads each one's published episode records,
checks them (a writer is another process: its records are not trusted), and moves
up to ``budget`` episodes into the shard with one
:meth:`~gear_mpi.shard.Shard.store_packed` call per writer -- a copy
of at most two slices per column (the staging ring's wrap), no Python per step or
per episode. Writers that closed or died are removed once their published episodes
are in; until then they are *draining* (:attr:`WriterIntake.draining`), counted apart
from the live writers. The intake also keeps what ``stats()`` reports of its writers:
the episodes and steps staged (ended, not yet ingested) and the end time of the newest
ingested episode (:meth:`WriterIntake.figures`). Local: no communication.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import secrets
import time
import weakref

import numpy as np

from ..kernels.hints import publish
from ..storage.arenas import SHM_DIR
from .staging import R_CLOSED, S_CLOSED, S_CONSUMED, S_CONSUMED_STEPS, Registry, Staging

log = logging.getLogger("gear_mpi")
_REAP_SECONDS = 0.2  # how often to look for writers that closed or died


class WriterIntake:
    """A rank's ingest point for :class:`~gear_mpi.feeds.writer.Writer` processes on its node.

    Args:
        shard: the :class:`~gear_mpi.shard.Shard` the episodes enter.
    Raises:
        ValueError: the spec is too large to describe in the registry.
    Cost: one 64 KiB shared-memory segment; each writer adds its own staging segment.
    """

    def __init__(self, shard):
        self.shard = shard
        self.registry = Registry.create(secrets.token_hex(8), shard.spec)
        self._address = self.registry.name
        # an owner that exits without close() still removes its writers' segments (SIGKILL: memory.cleanup());
        # a child forked from it that exits does not (they are the owner's)
        self._finalizer = weakref.finalize(self, _remove_segments, self._address + "_w", os.getpid())
        atexit.register(self._finalizer)
        self.writers: dict[int, Staging] = {}
        self.draining: set[int] = set()  # slots of writers that closed or died with episodes still to ingest
        self.ingested = 0
        self.staged = self.staged_steps = 0  # as last counted (backlog, drain): readable from any thread
        self.newest_ns = 0  # time.monotonic_ns() at the end of the newest ingested episode (0: none yet)
        self._reap_at = 0.0
        self._last = -1  # the slot of the writer served last: the next drain starts after it

    @property
    def address(self) -> str:
        """The writer address: the registry segment's name (still readable after close)."""
        return self._address

    def _discover(self) -> None:
        """Attach newly announced writers and free the slots of writers that closed or died with nothing left
        to ingest. Closed writers are seen at every call (a flag read each); dead ones (exited, killed or
        zombies: a syscall each) every ``_REAP_SECONDS``. Both run whether or not anything waits, so slots and
        ``stats()["writers"]`` follow the writers even while no episode is pending."""
        announced = np.flatnonzero(self.registry.announce.copy())  # writers announce while we look: a snapshot
        for slot in (announced.tolist() if len(announced) != len(self.writers) else ()):
            if slot in self.writers:
                continue
            staging = Staging.attach(self.registry, self.shard.spec, slot)
            if staging is None:  # announced, then gone or not valid: free the slot
                log.warning("writer slot %d of %s has no valid staging area; freeing it", slot, self.address)
                self._free(slot, None)
            else:
                self.writers[slot] = staging
        self._reap()

    def backlog(self) -> int:
        """Episodes ended by the writers and not yet ingested (attaches new writers first). O(writers)."""
        self._discover()
        return self._count()

    def _count(self) -> int:
        """Count the staged episodes and steps into ``staged`` and ``staged_steps``; return the episodes."""
        episodes = steps = 0
        for st in self.writers.values():
            e, n = st.pending()
            episodes, steps = episodes + e, steps + n
        self.staged, self.staged_steps = episodes, steps
        return episodes

    @property
    def live(self) -> int:
        """Writers attached that have neither closed nor died (as last looked: dead ones every 0.2 s). O(1)."""
        return len(self.writers) - len(self.draining)

    def age(self) -> float:
        """Seconds since the newest ingested episode ended (in its writer); ``inf`` before any (no data is
        infinitely old, and compares equal to itself, unlike NaN). O(1), any thread."""
        t = self.newest_ns
        return max(time.monotonic_ns() - t, 0) * 1e-9 if t else math.inf

    def figures(self) -> dict[str, float]:
        """What ``stats()`` reports of the writers (attaches new ones and counts first): ``writers`` (live),
        ``writers_draining`` (closed or died, episodes still to ingest), ``staged``, ``staged_steps`` (ended,
        not yet ingested) and ``ingested_age`` (:meth:`age`). O(writers)."""
        staged = self.backlog()
        return {"writers": self.live, "writers_draining": len(self.draining), "staged": staged,
                "staged_steps": self.staged_steps, "ingested_age": self.age()}

    def drain(self, budget: float) -> int:
        """Move up to ``budget`` ended episodes into the shard (oldest first per writer; the writers round-robin,
        from the one after the writer served last, so a budget smaller than one writer's backlog starves none).

        The caller has passed the node fence (nothing may read the shard's old steps). Local.
        Args:
            budget: the most episodes to take (``inf``: all).
        Returns:
            How many entered.
        Cost: O(writers) counter reads; per writer with episodes, one record check and one store_packed.
        """
        self._discover()
        total = 0
        slots = sorted(self.writers)
        first = next((i for i, slot in enumerate(slots) if slot > self._last), 0)
        for slot in slots[first:] + slots[:first]:
            if total >= budget:
                break
            st = self.writers[slot]
            try:
                # each store_packed takes what the shard holds at once (its slots, its steps): a backlog larger
                # than a small shard goes in several, the oldest evicted as by single inserts
                left = min(budget - total, st.published() - int(st.header[S_CONSUMED]))
                while left > 0:
                    n = self._drain_one(st, left)
                    if not n:
                        break
                    total, left, self._last = total + n, left - n, slot
            except _BrokenStaging as e:
                log.error("writer slot %d of %s: %s; dropping that writer", slot, self.address, e)
                self._free(slot, st)
        self._reap()
        self.ingested += total
        self._count()
        return total

    def _reap(self) -> None:
        """Free the slots of writers that closed or died and whose ended episodes are all in the shard."""
        now = time.monotonic()
        dead_too = now >= self._reap_at
        if dead_too:
            self._reap_at = now + _REAP_SECONDS
        for slot, st in list(self.writers.items()):
            # closed (or dead) first, then the count: a writer publishes its last episode before it closes
            if slot in self.draining or st.header[S_CLOSED] or (dead_too and st.writer_gone()):
                if st.published() == int(st.header[S_CONSUMED]):
                    self._free(slot, st)
                else:
                    self.draining.add(slot)

    def _drain_one(self, st: Staging, budget: float) -> int:
        done = int(st.header[S_CONSUMED])
        n = int(min(st.published() - done, budget))
        if n <= 0:
            return 0
        spec, store = self.shard.spec, self.shard.store
        recs = st.records[np.arange(done, done + n) % st.episodes]
        starts, lengths = recs[:, 0].copy(), recs[:, 1].copy()
        priorities = recs[:, 2].copy().view(np.float64)
        first = int(st.header[S_CONSUMED_STEPS])
        if lengths.min() < 1 or lengths.max() > spec.max_length:
            raise _BrokenStaging(f"an episode length outside [1, {spec.max_length}]")
        if starts[0] != first or (n > 1 and not np.array_equal(starts[1:], starts[:-1] + lengths[:-1])):
            raise _BrokenStaging("episode records that are not back to back")
        if not (np.isfinite(priorities).all() and (priorities >= 0).all()):
            raise _BrokenStaging("a priority that is negative or not finite")
        # no batch above the shard's capacity or slots (store_packed would refuse it)
        ends = np.cumsum(lengths)
        n = min(n, int(np.searchsorted(ends, store.capacity, side="right")), store.max_items)
        lengths, priorities, stop = lengths[:n], priorities[:n] + 0.0, first + int(ends[n - 1])
        if stop - first > st.steps:
            raise _BrokenStaging("more published steps than its ring holds")
        a = first % st.steps
        b = a + (stop - first)
        if b <= st.steps:
            columns = {name: ring[a:b] for name, ring in st.columns.items()}
        else:
            columns = {name: np.concatenate([ring[a:], ring[:b - st.steps]]) for name, ring in st.columns.items()}
        self.shard.store_packed(columns, lengths, priorities)
        st.mark_consumed(done + n, stop)
        ended = int(recs[n - 1, 3])  # the writer's clock reading (not trusted beyond "not in the future")
        if ended > self.newest_ns:
            self.newest_ns = min(ended, time.monotonic_ns())
        return n

    def _free(self, slot: int, st: Staging | None) -> None:
        """Forget a writer: clear its announce word first, then remove its segment (see :mod:`gear_mpi.feeds.staging`)."""
        publish(self.registry.announce[slot:slot + 1], 0)
        if st is not None:
            st.close(unlink=True)
        else:
            try:
                os.unlink(os.path.join(SHM_DIR, self.registry.staging_name(slot)))
            except FileNotFoundError:
                pass
        self.writers.pop(slot, None)
        self.draining.discard(slot)

    def close(self) -> int:
        """Tell the writers the replay is closed, remove every staging area and the registry. Idempotent.

        Returns:
            Ended episodes discarded: staged and not ingested (logged at INFO level when any).
        """
        if self.registry is None:
            return 0
        publish(self.registry.words[R_CLOSED:R_CLOSED + 1], 1)  # writers raise WriterError from now on
        discarded = self.backlog()
        if discarded:
            log.info("closing ingest point %s discards %d ended episodes (%d steps) its writers staged and it did "
                     "not ingest", self.address, discarded, self.staged_steps)
        for slot in np.flatnonzero(self.registry.announce.copy()).tolist():
            self._free(slot, self.writers.get(slot))
        for slot, st in list(self.writers.items()):
            self._free(slot, st)
        self.registry.close()
        self.registry = None
        self._finalizer()
        return discarded

    def __repr__(self) -> str:
        return f"WriterIntake({self.address!r}, writers={len(self.writers)}, ingested={self.ingested})"


def _remove_segments(prefix: str, pid: int) -> None:
    """Unlink every segment whose name starts with ``prefix`` (a closed ingest point's staging areas), when
    called in process ``pid`` (the owner's): in a child forked from it, nothing (the owner still drains them)."""
    if os.getpid() != pid:
        return
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


class _BrokenStaging(Exception):
    """A writer's staging area holds records no correct writer writes."""

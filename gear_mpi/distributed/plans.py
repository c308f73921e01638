"""Selection plans: which items each owner serves to each requester in one ``Replay.sample``.

A plan turns the *header* of a sample -- a row per rank, laid out, built and
agreed by :mod:`gear_mpi.distributed.header` (the call's arguments, each shard's
selection mass, live items and smallest weight, the rate limiter's counts) -- into
an :class:`Assignment`: the slots this rank serves, in requester order, with how
many go to each requester and how many this rank receives from each owner.
Every plan handles both kinds of selector: proportional (Uniform, Prioritized:
draws over the weights) and ordered (Fifo, Lifo, Max/MinPriority: the globally
best items).

- :class:`DecentralizedPlan` -- no further message for proportional selectors
  (the count matrix is drawn from a stream every rank holds); one allgatherv of
  candidates for ordered ones.
- :class:`CentralizedPlan` -- rank 0 gathers the selection state, selects for
  everybody and scatters the choices; one alltoall of counts.
- :class:`LocalPlan` -- each rank serves itself from its own shard; no message.

Every mode's plan is built once over the same shard (:func:`build_plans`); a sample
picks one per call, and the mode code in the header makes every rank agree on it
(:func:`~gear_mpi.distributed.header.check_mode`). Costs are in each class's docstring
(``P`` ranks, ``Btot`` items asked in all).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from .comm import MpiComm, displacements
from .header import BATCH, ITEMS, MASS, MIN_WEIGHT, MODES
from ..shard import Shard


class Assignment(NamedTuple):
    """What one rank does in the exchange of a sample.

    ``slots``: the items this rank serves, in requester order (``send_counts[r]`` for requester r);
    ``recv_counts[o]``: how many items owner o serves this rank; ``mass`` and ``min_weight``: the
    selection mass and smallest weight the draw was made over (for probabilities and importance weights);
    ``counts[r, o]``: items owner o serves requester r, when every rank knows them all (decentralized
    plans; None otherwise): the node board then carries the choices (:class:`~gear_mpi.distributed.node.NodeBoard`).
    """
    slots: np.ndarray
    send_counts: np.ndarray
    recv_counts: np.ndarray
    mass: float
    min_weight: float
    counts: np.ndarray | None = None


class Plan(ABC):
    """Selection for one mode of ``Replay.sample`` (see the module docstring).

    Args:
        comm: the replay's communicator.
        shard: this rank's shard.
        rng: this rank's own stream (rank 0 draws with it in the centralized mode).
        shared_rng: a stream every rank holds and advances identically.
    """

    def __init__(self, comm: MpiComm, shard: Shard, rng: np.random.Generator, shared_rng: np.random.Generator):
        self.comm = comm
        self.shard = shard
        self.rng = rng
        self.shared_rng = shared_rng
        self.proportional = shard.selector.proportional
        self.rank, self.size = comm.rank, comm.size

    @abstractmethod
    def assign(self, head: np.ndarray) -> Assignment:
        """Turn the agreed header into this rank's assignment.

        Collective for the decentralized (ordered selectors) and centralized plans; see each class for its cost.
        Args:
            head: ``[ranks, HEADER_WIDTH]`` float64, a row per rank (this rank's row only for :class:`LocalPlan`).
        Returns:
            This rank's :class:`Assignment`.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline.
        """

    def _finish(self, head: np.ndarray, assign: list[np.ndarray], recv_counts: np.ndarray) -> Assignment:
        """An assignment from per-requester slot lists."""
        send_counts = np.array([len(a) for a in assign], np.int64)
        slots = np.concatenate(assign).astype(np.int64, copy=False)
        return Assignment(slots, send_counts, recv_counts, *_mass(head))


def _mass(head: np.ndarray) -> tuple[float, float]:
    """Total selection mass (summed in rank order) and smallest weight over the header's ranks."""
    return sum(head[:, MASS].tolist()), min(head[:, MIN_WEIGHT].tolist())


class DecentralizedPlan(Plan):
    """Every rank computes the whole selection's shape; each owner selects its own items.

    Proportional: counts[r, o] ~ Multinomial(B_r, mass_o / total), independently per requester
    r, drawn from the shared stream, so the whole count matrix is known everywhere without a
    message; each owner then draws that many items from its shard: P(item) = w / total exactly.
    Ordered: one allgatherv of each shard's ``min(Btot, size)`` best sort keys (8 bytes each);
    every rank computes the same global merge (O(C log C) for C candidates).
    """

    def assign(self, head: np.ndarray) -> Assignment:
        """Turn the agreed header into this rank's assignment (see the class docstring for the cost).

        Args:
            head: the agreed header, ``[ranks, HEADER_WIDTH]`` float64.
        Returns:
            This rank's :class:`Assignment`.
        Raises:
            CollectiveTimeoutError: (ordered selectors) a rank did not arrive within the deadline.
        """
        sizes = head[:, BATCH].astype(np.int64)
        if self.proportional:
            mass, wmin = _mass(head)
            if mass > 0.0:
                counts = multinomial_rows(self.shared_rng, sizes, head[:, MASS] / mass)
            else:  # nothing to draw from, so nothing asked (check_header): no multinomial over NaN shares
                counts = np.zeros((self.size, self.size), np.int64)
            serve = np.ascontiguousarray(counts[:, self.rank])
            return Assignment(self.shard.select(int(serve.sum())), serve, counts[self.rank], mass, wmin, counts)
        btot = int(sizes.sum())
        slots, keys = self.shard.ordered_candidates(btot)
        ncand = np.minimum(head[:, ITEMS].astype(np.int64), btot)
        all_keys = self.comm.allgatherv(keys, ncand, "sample (candidates)")
        owner, index, requester = global_order(all_keys, ncand, sizes)
        me = owner == self.rank
        serve_req, serve_idx = requester[me], index[me]
        assign = [slots[serve_idx[serve_req == r]] for r in range(self.size)]
        recv = np.bincount(owner[requester == self.rank], minlength=self.size)
        counts = np.bincount(requester * self.size + owner, minlength=self.size * self.size)
        return self._finish(head, assign, recv)._replace(counts=counts.reshape(self.size, self.size))


class CentralizedPlan(Plan):
    """Rank 0 gathers the selection state of every shard, selects for every rank and scatters the
    (requester, slot) pairs to the owners; then one alltoall of counts.

    Proportional: the state is every live weight (16 bytes per item); ordered: each shard's
    ``min(Btot, size)`` best candidates (16 bytes each). O(items) at rank 0.
    """

    def assign(self, head: np.ndarray) -> Assignment:
        """Turn the agreed header into this rank's assignment (see the class docstring for the cost).

        Collective: a gatherv to rank 0, a scatterv of the choices, an alltoall of counts.
        Args:
            head: the agreed header, ``[ranks, HEADER_WIDTH]`` float64.
        Returns:
            This rank's :class:`Assignment`.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline.
            Exception: rank 0's selection failed (e.g. MemoryError): its class and message on every rank
                (``"sample (scatter choices): rank 0: ..."``), the ranks still in step.
        """
        sizes = head[:, BATCH].astype(np.int64)
        items = head[:, ITEMS].astype(np.int64)  # each shard sends at most 2 int64 a live item
        if self.proportional:
            slots, weights = self.shard.live_weights()
            packed = np.stack([slots, weights.view(np.int64)], 1).reshape(-1)
        else:
            items = np.minimum(items, int(sizes.sum()))
            slots, keys = self.shard.ordered_candidates(int(sizes.sum()))
            packed = np.stack([slots, keys], 1).reshape(-1)
        buffer = error = None
        if self.rank == 0:  # the gather's buffer, for every live item of the replay: failing, every rank raises
            try:
                buffer = self._state_buffer(int(items.sum()))
            except MemoryError as e:
                error = MemoryError(f"rank 0 cannot hold the selection state of {int(items.sum())} items "
                                    f"({16 * int(items.sum()) / 2**30:.1f} GiB): {e}")
        gathered, counts = self.comm.gatherv(packed, 0, "sample (gather state)", buffer, error)
        chunks = error = None
        if self.rank == 0:  # its failure (e.g. MemoryError: 16 bytes per item of the whole replay) goes to every
            try:            # rank through the scatter, instead of leaving the others to wait out the deadline
                chunks = self._choose(sizes, items, gathered, counts)
            except Exception as e:  # noqa: BLE001 -- any error is reported, on every rank
                error = e
        pairs = self.comm.scatterv(chunks, np.int64, 0, "sample (scatter choices)", error).reshape(-1, 2)
        assign = [pairs[pairs[:, 0] == r, 1] for r in range(self.size)]
        recv = self.comm.alltoall(np.array([len(a) for a in assign], np.int64), "sample (counts)")
        return self._finish(head, assign, recv)

    @staticmethod
    def _state_buffer(items: int) -> np.ndarray:
        """Rank 0's buffer for the gathered state of ``items`` items (int64 pairs). Local, O(1) (not touched)."""
        return np.empty(2 * items, np.int64)

    def _choose(self, sizes: np.ndarray, items: np.ndarray, gathered: np.ndarray, counts: np.ndarray) -> list:
        """Rank 0's selection for every rank from the gathered state (``items``: each shard's candidates, for
        ordered selectors): one int64 array of (requester, slot) pairs per owner. Local, O(items)."""
        table = gathered.reshape(-1, 2)
        chunks = []
        if self.proportional:
            owner = np.repeat(np.arange(self.size), counts // 2)
            cum = np.cumsum(table[:, 1].view(np.float64))
            draws = self.rng.random(int(sizes.sum()))
            if len(draws):  # then some weight is positive (check_header)
                picks = np.searchsorted(cum, draws * cum[-1], side="right")
                picks = np.minimum(picks, len(cum) - 1)
            else:  # nothing asked: no item, and maybe no weight, to pick from
                picks = np.zeros(0, np.int64)
            requester = np.repeat(np.arange(self.size), sizes)
            for o in range(self.size):
                mine = owner[picks] == o
                # (requester, slot) pairs, already in requester order
                chunks.append(np.stack([requester[mine], table[picks[mine], 0]], 1).reshape(-1))
        else:
            owner, index, requester = global_order(table[:, 1], items, sizes)
            offsets = displacements(items)
            for o in range(self.size):
                mine = owner == o
                chunks.append(np.stack([requester[mine], table[offsets[o] + index[mine], 0]], 1).reshape(-1))
        return chunks


class LocalPlan(Plan):
    """Each rank serves itself from its own shard; no message. The header holds this rank's row
    only (nothing is agreed); probabilities and weights are those of the local shard.

    Raises:
        EmptyReplayError: items are asked of an empty shard.
    """

    def assign(self, head: np.ndarray) -> Assignment:
        """This rank's assignment: ``head[0, BATCH]`` of its own items. Local; selection as :meth:`Shard.select`.

        Args:
            head: this rank's header row, ``[1, HEADER_WIDTH]`` float64.
        Returns:
            An :class:`Assignment` that serves this rank only.
        Raises:
            EmptyReplayError: items are asked of an empty shard (or one whose weights are all 0).
        """
        batch_size = int(head[0, BATCH])
        if batch_size:
            self.shard.check_can_sample()
        counts = np.zeros(self.size, np.int64)
        counts[self.rank] = batch_size
        return Assignment(self.shard.select(batch_size), counts, counts, *_mass(head))


PLANS: dict[str, type[Plan]] = {"decentralized": DecentralizedPlan, "centralized": CentralizedPlan,
                                "local": LocalPlan}


def build_plans(comm: MpiComm, shard: Shard, rng: np.random.Generator,
                shared_rng: np.random.Generator) -> dict[str, Plan]:
    """One plan per mode of :data:`MODES`, all over the same shard and streams (local, O(modes)).

    Args:
        comm, shard, rng, shared_rng: as :class:`Plan` takes them.
    Returns:
        Mode name -> its plan; a sample picks one per call.
    """
    return {mode: PLANS[mode](comm, shard, rng, shared_rng) for mode in MODES}


ROW_BY_ROW_RANKS = 4  # up to this many ranks, one multinomial call per requester is the cheaper way


def multinomial_rows(rng: np.random.Generator, sizes: np.ndarray, pvals: np.ndarray) -> np.ndarray:
    """``rng.multinomial(sizes, pvals)``: the same values from the same stream, cheaper for a few ranks.

    numpy's multinomial over an array of trial counts draws row after row, as calls with each count do; its
    broadcasting costs about 6-11 us a call, a call with one count 1.5 us (two ranks: 2.5 against 6-11 us),
    so up to :data:`ROW_BY_ROW_RANKS` requesters each row is its own call; over two owners a row is numpy's
    own first step, ``binomial(n, pvals[0])`` (the same value and stream, 0.5 against 1.2 us). Local, O(ranks^2).

    Args:
        rng: the stream (the shared one: every rank draws the same).
        sizes: int64 trials per row (requester); pvals: float64 probabilities per column (owner), summing to 1.
    Returns:
        int64 ``[len(sizes), len(pvals)]``.
    """
    if len(sizes) > ROW_BY_ROW_RANKS:
        return rng.multinomial(sizes, pvals)
    counts = np.empty((len(sizes), len(pvals)), np.int64)
    if len(pvals) == 2:  # numpy's multinomial over two owners is one binomial draw: the same call, 1 us less
        p0 = float(pvals[0])
        for r, n in enumerate(sizes.tolist()):
            first = int(rng.binomial(n, p0))
            counts[r, 0], counts[r, 1] = first, n - first
        return counts
    for r, n in enumerate(sizes.tolist()):
        counts[r] = rng.multinomial(n, pvals)
    return counts


def two_owner_rows(rng: np.random.Generator, sizes: list, mass0: float, mass: float) -> list[tuple[int, int]]:
    """:func:`multinomial_rows` over two owners, in Python lists: ``binomial(n, mass0 / mass)`` a row, the same
    values from the same stream as ``multinomial_rows(rng, np.array(sizes, np.int64), np.array([mass0, mass1])
    / mass)`` (``mass0 / mass`` is that array's first entry, bit for bit), without its arrays (about 2 us of a
    5 us call). Local, O(rows).

    Args:
        rng: the stream (the shared one); sizes: trials per row, integral (floats of the head table allowed);
        mass0: the first owner's mass; mass: the total, ``mass0 + mass1`` as the caller summed it.
    Returns:
        ``[(first owner's count, second owner's count), ...]``, one pair per row.
    """
    p0 = mass0 / mass
    rows = []
    for n in sizes:
        n = int(n)
        first = int(rng.binomial(n, p0))
        rows.append((first, n - first))
    return rows


def global_order(keys: np.ndarray, ncand: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge candidate lists (concatenated by owner, each best first) into the global order.

    Picks are dealt to requesters in rank order, cycling through the candidates when fewer exist than
    asked. Ties: lower owner rank, then the owner's own order. Cost: O(C log C) for C candidates; local.
    Args:
        keys: every owner's candidate sort keys (int64, smaller is better), owner by owner.
        ncand: candidates of each owner.
        sizes: items each requester asks for.
    Returns:
        ``(owner, index in the owner's list, requester)``, int64, one entry per pick (``sum(sizes)``).
    """
    owner_all = np.repeat(np.arange(len(ncand)), ncand)
    index_all = np.arange(len(keys)) - np.repeat(displacements(ncand), ncand)
    order = np.lexsort((index_all, owner_all, keys))
    btot = int(sizes.sum())
    picks = np.resize(order, btot) if len(order) else np.zeros(0, np.int64)
    requester = np.repeat(np.arange(len(sizes)), sizes)
    return owner_all[picks], index_all[picks], requester

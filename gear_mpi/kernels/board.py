"""The node board's rounds, each side of one in a single call (CPU kernels over the boards' addresses; issue 34).

When every rank of a replay shares one node, its collectives' heads and a sample's choices travel through small
shared segments, one a rank: its *board* (:class:`~gear_mpi.distributed.node.NodeBoard` maps them and keeps what
no kernel does: the waits past a short poll, the futex sleeps and wakes, the deadline). The layout is set here:
a head counter, a choices counter and a sleeping word (32-bit, at :data:`HEAD_COUNT`, :data:`CHOICE_COUNT`,
:data:`SLEEPING`), two head rows of :data:`ROW` float64 (:data:`ROWS`: a rank is at most one round ahead of
another), then the choices the rank serves (:data:`SLOT` onwards, ``CHOICE_WIDTH`` int64 each).

A round of a repeated two-rank W1 sample was some twenty Python and numpy steps (a row written, a counter
published between fences, the sleepers read, the peers' counters polled, their rows copied out), 1-4 us each
with the caches cold after the window copy: about 40 us of a 0.25 ms call. Here each side of a round is one
call, with the same stores in the same order: a counter is stored after everything it vouches for (release,
behind a full fence) and read before anything it vouches for (acquire, then a full fence), and a publisher
reads the sleeping words only after its counter is stored (a full fence between), so a peer that set its word
before sleeping is either seen here or sees the new counter itself.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from .gather import CHOICE_WIDTH
from .hints import address_pointer, cycle_count, fence, load_u32_acquire, spin_pause, store_u32_release

HEAD_COUNT = 0  # uint32: the head rounds this rank has published
PAIR_COUNT = 32  # uint32: the routed updates whose (key, priority) pairs this rank's board holds
CHOICE_COUNT = 64  # uint32: the sample (epoch) whose choices this rank's board holds
SLEEPING = 96  # uint32: 1 + the rank on whose counter this rank sleeps (0: it does not)
ROWS = 128  # float64 [2, ROW]: the head rows of odd and even rounds
ROW = 16  # float64 a head row holds
SLOT = 512  # bytes before the choices: int64 [capacity, CHOICE_WIDTH] (or a routed update's pairs: int64 [*, 2])

#: how long a kernel polls a peer's counter before it leaves the wait to the caller (which yields its core between
#: polls, then sleeps: NodeBoard.wait): at most POLL_SPINS reads, a pause between two, and about POLL_CYCLES of the
#: cycle counter (8-16 us at 2-4 GHz; a peer in step with this rank publishes well within it)
POLL_SPINS = 1 << 10
POLL_CYCLES = 1 << 15
#: the same where a node's ranks outnumber its cores (the caller's choice): a few reads, then the yielding wait
POLL_SPINS_SHARED = 4
POLL_CYCLES_SHARED = 1 << 10


@njit(cache=True, inline="always")
def _reached(value, target):
    """Whether a 32-bit counter's ``value`` has reached ``target`` (modulo 2**32: wrapping is harmless)."""
    return ((value - target) & 0xFFFFFFFF) < 0x80000000


@njit(cache=True, inline="always")
def _publish(bases, rank, offset, value):
    """Store ``value`` in this rank's counter at ``offset`` after everything before (a full fence, a release
    store), then, after another full fence, whether a node peer sleeps on one of this rank's counters."""
    fence()
    store_u32_release(bases[rank] + offset, value)
    fence()
    for r in range(bases.shape[0]):
        if load_u32_acquire(bases[r] + SLEEPING) == rank + 1:
            return True
    return False


@njit(cache=True, inline="always")
def _poll(address, target, t0, spins, cycles):
    """Whether the counter at ``address`` reaches ``target`` within ``spins`` reads (a pause between two) and
    about ``cycles`` since ``t0`` (checked every 64 reads)."""
    for i in range(spins):
        if _reached(load_u32_acquire(address), target):
            return True
        spin_pause()
        if (i & 63) == 63 and cycle_count() - t0 > cycles:
            return False
    return False


@njit(cache=True, inline="always")
def _segment(counts, rank, source):
    """Where ``rank``'s rows begin in ``source``'s list, and how many: ``counts[rank, source]`` of them, after those
    of the ranks before it (``counts[r, source]``, ``r < rank``)."""
    first = 0
    for r in range(rank):
        first += counts[r, source]
    return first, counts[rank, source]


@njit(cache=True, inline="always")
def _arrived(bases, expect, skip, offset, target, spins, cycles):
    """Poll the counter at ``offset`` of every rank ``r`` (but ``skip``) with ``expect[r] > 0`` until it reaches
    ``target`` (:func:`_poll`'s bounds, together); once all have, a fence (nothing they vouch for read before), and
    the sum of ``expect``. -1 when one has not."""
    t0 = cycle_count()
    total = 0
    for r in range(bases.shape[0]):
        if expect[r] > 0 and r != skip and not _poll(bases[r] + offset, target, t0, spins, cycles):
            return -1
        total += expect[r]
    fence()
    return total


@njit(cache=True, nogil=True)
def share_row(bases, rank, n, row):
    """Round ``n`` of the heads, this rank's side: ``row`` (float64, at most :data:`ROW` numbers) into its board's
    row ``n & 1``, then ``n`` published on its head counter.

    Args:
        bases: int64, every rank's board address (rank order); rank: this rank; n: the round.
        row: the numbers.
    Returns:
        Whether a node peer sleeps on one of this rank's counters (the caller wakes it). O(len(row) + ranks).
    """
    if row.shape[0] > ROW:
        raise ValueError("node board: a head row holds at most 16 numbers")
    rows = numba.carray(address_pointer(bases[rank] + ROWS), (2, ROW), np.float64)
    for j in range(row.shape[0]):
        rows[n & 1, j] = row[j]
    return _publish(bases, rank, HEAD_COUNT, n)


@njit(cache=True, nogil=True)
def gather_rows(bases, n, table, spins, cycles):
    """Every rank's head row of round ``n`` into ``table`` (float64 ``[ranks, width]``, row r from rank r), once
    each has published ``n`` (each counter polled: :func:`_poll`'s bounds, all together).

    Returns:
        True with ``table`` filled; False when a rank had not published (nothing read: the caller waits, then
        calls again). O(ranks * width) once there.
    """
    t0 = cycle_count()
    for r in range(bases.shape[0]):
        if not _poll(bases[r] + HEAD_COUNT, n, t0, spins, cycles):
            return False
    fence()  # nothing of a peer's row read before its counter said it is there
    width = table.shape[1]
    if width > ROW:
        raise ValueError("node board: a head row holds at most 16 numbers")
    for r in range(bases.shape[0]):
        rows = numba.carray(address_pointer(bases[r] + ROWS), (2, ROW), np.float64)
        for j in range(width):
            table[r, j] = rows[n & 1, j]
    return True


@njit(cache=True, nogil=True)
def publish_choices(bases, rank, epoch):
    """Owner: the choices in this rank's board are sample ``epoch``'s: ``epoch`` published on its choices counter.

    Returns:
        Whether a node peer sleeps on one of this rank's counters (the caller wakes it). O(ranks).
    """
    return _publish(bases, rank, CHOICE_COUNT, epoch)


@njit(cache=True, nogil=True)
def collect_choices(bases, rank, counts, epoch, own, got, capacity, spins, cycles):
    """Requester: this rank's choices of every owner, in owner order, into ``got``, once each owner that serves it
    (``counts[rank, o] > 0``, ``o != rank``) has published ``epoch`` (polled: :func:`_poll`'s bounds, together).
    Owner ``o``'s rows for this rank begin after those it serves the ranks before this one
    (``counts[:rank, o].sum()``); this rank's own come from ``own``, the others from their boards.

    Args:
        bases: int64 board addresses; rank: this rank; counts: int64 ``[ranks, ranks]``, items owner o serves
            requester r at ``[r, o]``; epoch: the sample's number; own: int64 ``[*, CHOICE_WIDTH]``, this rank's
            served choices; got: int64 ``[>= sum(counts[rank]), CHOICE_WIDTH]``; capacity: choices a board holds.
    Returns:
        True with ``got`` filled; False when an owner had not published (nothing copied: the caller waits, then
        calls again). O(ranks**2 + items).
    Raises:
        ValueError: ``got`` too short, or an owner's rows past its board or ``own``.
    """
    size = bases.shape[0]
    total = _arrived(bases, counts[rank], rank, CHOICE_COUNT, epoch, spins, cycles)
    if total < 0:
        return False
    if total > got.shape[0]:
        raise ValueError("node board: more choices than the requester's rows")
    row = 0
    for o in range(size):
        first, k = _segment(counts, rank, o)
        if k <= 0:
            continue
        if o == rank:
            if first + k > own.shape[0]:
                raise ValueError("node board: choices past the owner's rows")
            for i in range(k):
                for c in range(CHOICE_WIDTH):
                    got[row + i, c] = own[first + i, c]
        else:
            if first + k > capacity:
                raise ValueError("node board: choices past the owner's board")
            src = numba.carray(address_pointer(bases[o] + SLOT), (capacity, CHOICE_WIDTH), np.int64)
            for i in range(k):
                for c in range(CHOICE_WIDTH):
                    got[row + i, c] = src[first + i, c]
        row += k
    return True


@njit(cache=True, nogil=True)
def post_pairs(bases, rank, n, pairs, capacity):
    """A routed update's side as sender: its ``(key, priority bits)`` pairs (int64 ``[k, 2]``, sorted by owner)
    into this rank's board, then ``n`` (the update's number) published on its pair counter.

    Returns:
        Whether a node peer sleeps on one of this rank's counters (the caller wakes it). O(k + ranks).
    Raises:
        ValueError: more pairs than the board holds (``capacity`` int64 words after :data:`SLOT`).
    """
    k = pairs.shape[0]
    if 2 * k > capacity:
        raise ValueError("node board: more update pairs than a board holds")
    words = numba.carray(address_pointer(bases[rank] + SLOT), (capacity,), np.int64)
    for i in range(k):
        words[2 * i] = pairs[i, 0]
        words[2 * i + 1] = pairs[i, 1]
    return _publish(bases, rank, PAIR_COUNT, n)


@njit(cache=True, nogil=True)
def collect_pairs(bases, rank, counts, n, got, capacity, spins, cycles):
    """A routed update's side as owner: the pairs every rank posted for this one (``counts[r, o]``: pairs rank
    ``r`` has for owner ``o``; rank ``r``'s for this rank begin after those for the owners before it), in rank
    order, into ``got`` (int64 ``[>= sum(counts[:, rank]), 2]``), once every rank that sends some has published
    ``n`` (polled: :func:`_poll`'s bounds, together).

    Returns:
        True with ``got`` filled; False when a sender had not published (nothing copied: the caller waits, then
        calls again). O(ranks**2 + pairs).
    Raises:
        ValueError: ``got`` too short, or a sender's pairs past its board.
    """
    size = bases.shape[0]
    total = _arrived(bases, counts[:, rank], -1, PAIR_COUNT, n, spins, cycles)
    if total < 0:
        return False
    if total > got.shape[0]:
        raise ValueError("node board: more update pairs than the owner's rows")
    row, by_owner = 0, counts.T
    for r in range(size):
        first, k = _segment(by_owner, rank, r)  # (sender r's pairs for the owners before this one come first)
        if k <= 0:
            continue
        if 2 * (first + k) > capacity:
            raise ValueError("node board: update pairs past a sender's board")
        words = numba.carray(address_pointer(bases[r] + SLOT), (capacity,), np.int64)
        for i in range(k):
            got[row + i, 0] = words[2 * (first + i)]
            got[row + i, 1] = words[2 * (first + i) + 1]
        row += k
    return True

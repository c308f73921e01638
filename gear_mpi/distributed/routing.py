"""Key-routed collectives: requests by key, sent to the rank that owns each key, answered there.

A key names its owner rank (:mod:`gear_mpi.keys`), so any rank may hold keys of
any shard. Two collectives of ``Replay`` route them:

- :func:`route_priorities` -- new priorities to their owners (``update_priorities``);
  :func:`route_deferred` -- the same for ``batches()``'s thread, in one allgather (in flight with the call's
  head) when the keys fit;
- :func:`get_many` (its keys checked and agreed, then :func:`fetch`) -- whole trajectories from
  their owners back to the ranks that asked (``Replay.get_many``), over plain MPI for every rank,
  node peers included.

The exchanges (:func:`route_priorities`, :func:`route_deferred`, :func:`fetch`) take keys already
checked by :func:`check_keys` and agreed (the call's head, :mod:`gear_mpi.distributed.calls`; :func:`get_many` does both for
:func:`fetch`), so an owner never meets a key it cannot resolve in the middle of an exchange.
Every function here is collective except :func:`check_keys`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import keys as keyspace
from .calls import VALUES, ReplayCalls
from .comm import MpiComm, displacements
from ..errors import InvalidKeyError
from ..keys import as_key_array
from ..shard import Shard


def check_keys(keys: Any, tag: int, ranks: int, max_items: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check that every key was issued by this replay, and name its owner. O(n), local, one kernel pass
    (:func:`gear_mpi.keys.owners_checked`).

    Args:
        keys: keys of any rank (int, sequence, numpy array or tensor).
        tag: the replay's key tag.
        ranks: ranks of the replay.
        max_items: trajectory slots of every shard (the same on every rank).
    Returns:
        ``(keys, owner, counts)``: int64 arrays, one entry per key for the first two; ``counts[r]`` the keys
        rank ``r`` owns.
    Raises:
        TypeError: the keys are not integers.
        InvalidKeyError: a key of another replay, or naming a rank or slot the replay does not have.
    """
    keys = as_key_array(keys)
    keys = keys if keys.flags.c_contiguous else np.ascontiguousarray(keys)
    owner, counts = np.empty(keys.shape[0], np.int64), np.empty(ranks, np.int64)
    bad = keyspace.owners_checked(keys, tag, ranks, max_items, owner, counts)
    if bad >= 0:
        raise InvalidKeyError(f"key {int(keys[bad])} was not issued by this replay")
    return keys, owner, counts


def _to_owners(comm: MpiComm, keys: np.ndarray, owner: np.ndarray, what: str, recv_counts=None, send_counts=None):
    """Sort the keys by owner and tell each owner how many it gets: one alltoall of 8 bytes a pair,
    unless ``recv_counts`` (what every rank sends this one) is already known. ``send_counts``: the keys each
    rank owns, when known (:func:`check_keys`)."""
    order = np.argsort(owner, kind="stable")
    if send_counts is None:
        send_counts = np.bincount(owner, minlength=comm.size).astype(np.int64)
    if recv_counts is None:
        recv_counts = comm.alltoall(send_counts, f"{what} (counts)")
    return order, send_counts, np.asarray(recv_counts, np.int64)


def route_priorities(comm: MpiComm, shard: Shard, keys: np.ndarray, owner: np.ndarray,
                     priorities: np.ndarray, recv_counts: np.ndarray | None = None, count_back: bool = True,
                     send_counts: np.ndarray | None = None) -> int:
    """Collective: each key's new priority goes to its owner, which applies it.

    Args:
        comm: the replay's communicator; shard: this rank's shard.
        keys, owner: as :func:`check_keys` returns them; priorities: validated, one per key.
        recv_counts: keys each rank sends this one, when every rank already knows them (then no alltoall
            of counts); None: exchanged here.
        count_back: tell each rank how many of its keys were applied (one alltoall); False: return how
            many keys this rank's shard applied, whoever sent them.
        send_counts: the keys each rank owns, when known (:func:`check_keys`' counts); None: counted here.
    Returns:
        How many of this rank's keys were applied (stale keys are dropped and counted by their owner);
        with ``count_back=False``, how many this rank's shard applied.
    Raises:
        CollectiveTimeoutError: a rank did not arrive within the deadline.
    Cost: one alltoall of counts (none with ``recv_counts``), one alltoallv of 16 bytes per key, one
    alltoall of applied counts (none without ``count_back``); O(n) on the owner plus one batched
    index update. Duplicates: the highest rank's value wins, and within a rank the last one.
    """
    order, send_counts, recv_counts = _to_owners(comm, keys, owner, "update_priorities", recv_counts, send_counts)
    got = np.empty((int(recv_counts.sum()), 2), np.int64)
    comm.alltoallv(_pairs(keys, priorities, order).reshape(-1), send_counts * 2, got.reshape(-1), recv_counts * 2,
                   "update_priorities (keys)")
    per_source = _apply_pairs(shard, got, recv_counts)
    if not count_back:
        return int(per_source.sum())
    back = comm.alltoall(per_source, "update_priorities (applied)")
    return int(back.sum())


def _pairs(keys: np.ndarray, priorities: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The ``(key, priority bits)`` pairs an update sends, int64 ``[n, 2]`` in ``order`` (by owner). O(n) (two
    column stores: about 1.3 us for 32 keys, against 3.1 for ``np.stack``)."""
    pairs = np.empty((order.shape[0], 2), np.int64)
    pairs[:, 0] = keys[order]
    pairs[:, 1] = priorities[order].view(np.int64)
    return pairs


def _apply_pairs(shard: Shard, got: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
    """Apply the pairs an owner received (``got``, in sender order, ``recv_counts[r]`` from rank ``r``): how many
    of each sender's keys were applied (int64, one entry a rank). O(n + ranks) plus one batched index update."""
    applied = shard.apply_priorities(got[:, 0], got[:, 1].view(np.float64).copy())
    per_source = np.zeros(recv_counts.shape[0], np.int64)
    at = 0
    for r, k in enumerate(recv_counts.tolist()):  # (a loop over the ranks: cheaper than repeat + bincount on a node)
        per_source[r] = np.count_nonzero(applied[at:at + k])
        at += k
    return per_source


def update_routed(calls: ReplayCalls, shard: Shard, error: BaseException | None, keys: np.ndarray,
                  owner: np.ndarray, counts: np.ndarray | None, priorities: np.ndarray, what: str, count_back: bool,
                  settle) -> int:
    """Collective: ``Replay.update_priorities`` after its keys were checked (not a deferred fold): the head, which
    carries whether the rank holds only its own keys and, up to ``VALUES - 1`` ranks, how many keys it has for
    each owner (so that no alltoall of counts follows); the node fence; then the keys applied where they are, or
    routed (:func:`route_priorities`).

    Args:
        calls: the replay's heads; shard: this rank's shard; error: this rank's exception (agreed: every rank
            raises the lowest failing rank's); keys, owner, counts: as :func:`check_keys` returns them (empty,
            and None, on error); priorities: validated, one per key; what: the head's call; count_back: as
            :func:`route_priorities`; settle: the node fence, called before the shard is written.
    Returns:
        As :func:`route_priorities` (every rank holding only its own keys: how many this rank's shard applied).
    Raises:
        the agreed error; CollectiveError: another rank is in another call; CollectiveTimeoutError: a rank did not
        arrive within the deadline.
    Cost: one head (a row on the node board on one node), then :func:`route_priorities` less its alltoall of
    counts where the head carried them.
    """
    comm, board = calls.comm, calls.board
    ranks, rank = comm.size, comm.rank
    counts = np.zeros(ranks, np.int64) if counts is None else counts
    own = float(counts[rank] == keys.shape[0])
    carried = ranks < VALUES
    table = calls.agree(error, what, [own, *counts.tolist()] if carried else [own])
    settle()
    if table[:, 0].all():  # every rank holds only its own keys (as after a local sample): nothing to route
        return int(shard.apply_priorities(keys, priorities).sum())
    if carried and board is not None:
        every = table[:, 1:1 + ranks].astype(np.int64)  # [sender, owner], the same on every rank
        if int(every.sum(1).max()) * 2 <= board.PAIR_WORDS:  # every rank's pairs fit its board: no MPI call
            return _route_on_board(board, shard, keys, owner, priorities, every, count_back, what)
    return route_priorities(comm, shard, keys, owner, priorities, table[:, 1 + rank] if carried else None,
                            count_back=count_back, send_counts=counts)


def _route_on_board(board, shard: Shard, keys: np.ndarray, owner: np.ndarray, priorities: np.ndarray,
                    every: np.ndarray, count_back: bool, what: str) -> int:
    """:func:`route_priorities` through the node board (every rank on one node): the pairs posted on each sender's
    board and collected by their owners (``NodeBoard.route_pairs``), applied in sender order (so duplicates resolve
    as there: the highest rank's value, within a rank the last), and, with ``count_back``, each owner's applied
    counts per sender shared as a head row. Collective."""
    got = board.route_pairs(_pairs(keys, priorities, np.argsort(owner, kind="stable")), every, f"{what} (keys)")
    per_sender = _apply_pairs(shard, got, every[:, board.rank])
    if not count_back:
        return int(per_sender.sum())
    back = board.gather(board.share(per_sender.astype(np.float64)), board.size, f"{what} (applied)")
    return int(back[:, board.rank].sum())


FOLD_KEYS = 16384  # keys a deferred update's allgather may carry in all (ranks x keys per rank): 256 KiB


def route_deferred(calls: ReplayCalls, shard: Shard, error: BaseException | None, keys: np.ndarray,
                   owner: np.ndarray, priorities: np.ndarray, width: int, settle) -> tuple[int, int]:
    """Collective: a deferred update (``batches()``'s thread): its head, and one allgather in flight with it
    that carries the counts, and the keys when they fit.

    The payload row of each rank carries whether it holds only its own keys, its per-owner counts and,
    when it has at most ``width`` keys, the keys and priorities themselves (``width`` keys per rank,
    padded): when every rank's fit, each owner takes its own keys from the table (in rank order, as an
    alltoallv would deliver them) and nothing more is sent; else one alltoallv of 16 bytes per key
    follows (the counts are known). ``width`` must be the same on every rank: it is the largest count
    of keys a rank gave in the previous deferred update (returned, agreed through the table), 0 at first.
    The head (an ``"update_priorities (batches)"`` call, :mod:`gear_mpi.distributed.calls`) carries the status
    and tells this call from another rank's other call.

    Args:
        calls: the replay's heads; shard: this rank's shard; error: this rank's exception (agreed: every rank
            raises the lowest failing rank's, as :meth:`MpiComm.agree`); keys, owner, priorities: as for
            :func:`route_priorities` (empty on error); width: keys per rank the row carries;
        settle: the node fence, called before the shard is written.
    Returns:
        ``(applied, width)``: how many keys this rank's shard applied (any rank's), and the width of the
        next deferred update.
    Raises:
        the agreed error; CollectiveError: another rank is in another call; CollectiveTimeoutError: a rank
        did not arrive within the deadline.
    Cost: the head, and in flight with it one allgather of ``8 (1 + ranks + 2 width)`` bytes a rank; plus
    one alltoallv when some rank's keys did not fit; O(ranks width) to pick this rank's keys.
    """
    comm = calls.comm
    size, rank, n = comm.size, comm.rank, len(keys)
    k0, v0 = 1 + size, 1 + size + width  # where the keys and the priority bits start in a row
    row = np.zeros(v0 + width, np.int64)
    row[k0:v0] = -1  # padding: owner_of(-1) is RANK_MASK, no rank of a fold, so no mask of valid entries
    if error is None:
        counts = np.bincount(owner, minlength=size)
        row[0] = counts[rank] == n  # only its own keys
        row[1:k0] = counts
        if n <= width:
            row[k0:k0 + n] = keys
            row[v0:v0 + n] = np.ascontiguousarray(priorities, np.float64).view(np.int64)
    _, table = calls.agree(error, "update_priorities (batches)", payload=row)  # raises the agreed error
    own = table[:, 0].tolist()  # the few per-rank flags as Python numbers: numpy's per-call overhead dominates
    counts = table[:, 1:k0]  # [sender, owner]
    most = int(counts.sum(1).max())
    following = most if most * size <= FOLD_KEYS else 0
    settle()
    if all(own):  # every rank holds only its own keys: nothing to route
        return int(np.count_nonzero(shard.apply_priorities(keys, priorities))), following
    if most > width:  # some rank's keys did not ride on the allgather
        return route_priorities(comm, shard, keys, owner, priorities, counts[:, rank], count_back=False), following
    carried = table[:, k0:v0]  # [sender, width]: the keys each rank carried (rank order), padded with -1
    mine = keyspace.owner_of(carried) == rank
    values = table[:, v0:][mine].view(np.float64)
    return int(np.count_nonzero(shard.apply_priorities(carried[mine], values))), following


def fetch(comm: MpiComm, shard: Shard, keys: np.ndarray, owner: np.ndarray) -> list[dict[str, np.ndarray] | None]:
    """Collective: the whole trajectory behind each key, read by its owner and sent back.

    Args:
        comm: the replay's communicator; shard: this rank's shard.
        keys, owner: as :func:`check_keys` returns them (any rank's keys; none is fine).
    Returns:
        One entry per key, in the order of ``keys``: column name -> ``[L, *shape]`` array (the
        arrays of one call share a buffer per column), or None for a stale key (evicted or removed).
    Raises:
        CorruptDataError, MemoryError: an owner could not read or pack its steps (a damaged compressed chunk),
            or a rank could not allocate what it receives (on every rank; nothing has been sent).
        CollectiveTimeoutError: a rank did not arrive within the deadline.
    Cost: one alltoall of counts, one alltoallv of 8 bytes per key each way (keys, then lengths), one
    agreement (an allgather of 8 bytes a rank), then one alltoallv per column, posted together, of
    ``L * step_bytes`` bytes per live trajectory.
    Every step is copied twice (the owner packs it, MPI delivers it), node peers and this rank's
    own keys included; O(total steps) on the owner.
    """
    order, send_counts, recv_counts = _to_owners(comm, keys, owner, "get_many")
    asked = np.empty(int(recv_counts.sum()), np.int64)
    comm.alltoallv(keys[order], send_counts, asked, recv_counts, "get_many (keys)")
    # the owner: lengths back (-1: stale), then the steps of the live ones, requester by requester
    store = shard.store
    slots, live = store.resolve(asked)
    lengths = np.where(live, store.length[slots].astype(np.int64), -1)
    got_lengths = np.empty(len(keys), np.int64)
    comm.alltoallv(lengths, recv_counts, got_lengths, send_counts, "get_many (lengths)")
    n_out, n_in = np.maximum(lengths, 0), np.maximum(got_lengths, 0)
    requester = np.repeat(np.arange(comm.size), recv_counts)
    steps_out = np.bincount(requester, weights=n_out, minlength=comm.size).astype(np.int64)
    steps_in = np.bincount(owner[order], weights=n_in, minlength=comm.size).astype(np.int64)
    step = np.arange(int(n_out.sum()), dtype=np.int64) - np.repeat(displacements(n_out), n_out)
    ring_steps = (np.repeat(np.where(live, store.start[slots].astype(np.int64), 0), n_out) + step) % store.capacity
    # packed and allocated before anything is sent: a damaged compressed chunk (CorruptDataError) or a failed
    # allocation on one owner fails on every rank here, instead of leaving the others in the exchange
    packed = None
    try:
        packed = [(np.ascontiguousarray(store.steps_at(c.name, ring_steps)),
                   np.empty((int(n_in.sum()),) + c.shape, c.dtype)) for c in shard.spec.columns]
        err = None
    except Exception as e:
        err = e
    comm.agree(err, "get_many (steps)")
    received, requests = {}, []
    for c, (send, recv) in zip(shard.spec.columns, packed):  # the sent buffers outlive the requests
        requests.append(comm.ialltoallv(send.reshape(-1).view(np.uint8), steps_out * c.step_bytes,
                                        recv.reshape(-1).view(np.uint8), steps_in * c.step_bytes))
        received[c.name] = recv
    comm.wait_all(requests, "get_many (steps)")
    del packed
    out: list[dict[str, np.ndarray] | None] = [None] * len(keys)
    first = displacements(n_in)
    for j, i in enumerate(order.tolist()):
        if got_lengths[j] >= 0:
            a, b = int(first[j]), int(first[j] + n_in[j])
            out[i] = {name: col[a:b] for name, col in received.items()}
    return out


def get_many(calls: ReplayCalls, shard: Shard, keys: Any,
             problem: Exception | None = None) -> list[dict[str, np.ndarray] | None]:
    """Collective: ``Replay.get_many``: check this rank's keys (:func:`check_keys`), agree that every rank's are
    good (a ``"get_many"`` head, :mod:`gear_mpi.distributed.calls`), then :func:`fetch` them from their owners.

    Args:
        calls: the replay's heads (and communicator); shard: this rank's shard.
        keys: keys issued by this replay, of any rank (an empty list is fine).
        problem: this rank's error already known (its mapped columns changed: :meth:`Shard.hold`), or None.
    Returns:
        As :func:`fetch`: one entry per key, in the given order (None where the key is stale).
    Raises:
        TypeError, InvalidKeyError: keys not integers, or not this replay's, on some rank (on every rank).
        CheckpointError: a rank's ``problem`` (on every rank).
        CollectiveError: another rank is in another call; CollectiveTimeoutError: a rank did not arrive in time.
    Cost: the head (one allgather, or a row on the node board), then :func:`fetch`.
    """
    comm = calls.comm
    err, owner = problem, None
    try:
        keys, owner, _ = check_keys(keys, shard.tag, comm.size, shard.store.max_items)
    except Exception as e:
        err, keys, owner = e, np.zeros(0, np.int64), np.zeros(0, np.int64)
    calls.agree(err, "get_many")
    return fetch(comm, shard, keys, owner)

"""Resharding: dealing a checkpoint's live trajectories to another number of ranks (or sizes).

Every rank reads every saved table (O(total items)), so all ranks compute the
same plan without communicating:

1. the live trajectories of all saved shards, in global insertion order (each
   shard's own order, merged by insertion stamp; the stamps are made
   non-decreasing along each shard's order first, so the merge keeps it);
2. dealt oldest first, each to the rank holding the fewest steps so far
   (shards end within ``max_length`` steps of each other);
3. per new shard, its oldest trajectories are dropped if they do not fit, as
   FIFO eviction would have done -- only when the caller allows it (``allow_drop=True``);
   otherwise the load fails on every rank, saying how many trajectories would be lost and
   which ``capacity_steps``/``max_items`` hold them all.

Each rank then inserts its trajectories, reading their steps from the saved
column files, and gives them back their insertion stamps and times sampled.
The new replay's key tag differs from the saved one, so an old key is refused.
"""
from __future__ import annotations

import heapq

import numpy as np

from .. import keys as keyspace
from ..errors import CheckpointError
from .. import progress
from ..distributed.comm import MpiComm
from ..kernels import ring
from ..progress import Meter, log
from . import shard_files
from .arrival import Channel
from .files import CHUNK_BYTES, SHARD_JSON, TABLE


def _live_records(tables: list[dict], metas: list[dict], tag: int, old_cap: int,
                  ranks: list[int] | None = None) -> dict[str, np.ndarray]:
    """The live trajectories of the saved shards ``ranks`` (default: all, ``tables[i]`` being saved rank ``i``),
    in global insertion order, one array per field."""
    recs = []
    for r, t, meta in zip(range(len(tables)) if ranks is None else ranks, tables, metas):
        # rows may be saved narrow (uint32 start, uint16 generation, ...): int64 for the arithmetic below
        t = {k: (v.astype(np.int64) if v.dtype.kind in "iu" else v) for k, v in t.items()}
        slots = np.flatnonzero(t["alive"] == ring.LIVE).astype(np.int64)
        slots = slots[np.argsort(t["seq"][slots], kind="stable")]
        stamp = np.maximum.accumulate(t["stamp"][slots]) if len(slots) else np.zeros(0, np.int64)
        head = shard_files.ring_head(meta)
        recs.append(dict(rank=np.full(len(slots), r, np.int64), slot=slots, stamp=stamp,
                         raw_stamp=t["stamp"][slots], seq=t["seq"][slots], length=t["length"][slots],
                         priority=t["priority"][slots], times=t["times_sampled"][slots],
                         offset=(t["start"][slots] - head) % old_cap,
                         key=keyspace.encode(tag, r, slots, t["generation"][slots])))
    allr = {k: np.concatenate([x[k] for x in recs]) for k in recs[0]}
    order = np.lexsort((allr["seq"], allr["rank"], allr["stamp"]))
    return {k: v[order] for k, v in allr.items()}


def deal(lengths: np.ndarray, ranks: int, capacity_steps: int, max_items: int, held_steps=None,
         held_items=None) -> tuple[np.ndarray, np.ndarray]:
    """Assign trajectories (oldest first, of ``lengths`` steps) to ``ranks`` new shards.

    Args:
        lengths: steps of each trajectory, in global insertion order.
        ranks: the number of new shards.
        capacity_steps: steps each new shard holds.
        max_items: trajectories each new shard holds.
        held_steps, held_items: steps and trajectories each new shard holds already (None: none); they are
            kept, and the dealt ones go first to the shards holding the fewest steps.
    Returns:
        ``(dest, keep)``: the new rank of each trajectory, and whether it fits
        (False for the oldest of a shard that cannot hold all it was dealt).
    Cost: O(n log ranks).
    """
    n = len(lengths)
    dest = np.empty(n, np.int64)
    held_steps = np.zeros(ranks, np.int64) if held_steps is None else np.asarray(held_steps, np.int64)
    held_items = np.zeros(ranks, np.int64) if held_items is None else np.asarray(held_items, np.int64)
    heap = [(int(held_steps[r]), r) for r in range(ranks)]
    heapq.heapify(heap)
    for i, length in enumerate(lengths.tolist()):
        steps, r = heapq.heappop(heap)
        dest[i] = r
        heapq.heappush(heap, (steps + length, r))
    keep = np.ones(n, bool)
    for r in range(ranks):
        idx = np.flatnonzero(dest == r)
        if len(idx) == 0:
            continue
        from_newest = np.cumsum(lengths[idx][::-1])[::-1]
        count_from_newest = np.arange(len(idx), 0, -1)
        keep[idx] = (from_newest <= capacity_steps - held_steps[r]) & (count_from_newest <= max_items - held_items[r])
    return dest, keep


def dropped_error(lengths: np.ndarray, dest: np.ndarray, keep: np.ndarray, ranks: int, capacity_steps: int,
                  max_items: int) -> CheckpointError | None:
    """The error of a deal that drops trajectories (None when it keeps them all). O(n), local.

    Args:
        lengths, dest, keep: the trajectories' steps and :func:`deal`'s result for them.
        ranks, capacity_steps, max_items: the new replay's ranks and per-shard sizes.
    Returns:
        A :class:`~gear_mpi.errors.CheckpointError` naming how many trajectories and steps would be
        lost and the per-shard sizes that would hold every one of them, or None.
    """
    lost = int((~keep).sum())
    if not lost:
        return None
    steps_needed = int(np.bincount(dest, weights=lengths, minlength=ranks).max())
    items_needed = int(np.bincount(dest, minlength=ranks).max())
    return CheckpointError(
        f"loading this checkpoint onto {ranks} rank(s) with capacity_steps={capacity_steps}, max_items={max_items} "
        f"would drop {lost} of {len(lengths)} trajectories ({int(lengths[~keep].sum())} of {int(lengths.sum())} "
        f"steps): capacity_steps={max(steps_needed, capacity_steps)} and max_items="
        f"{max(items_needed, max_items)} per rank hold them all; or pass allow_drop=True to keep the newest that fit")


def reshard(replay, comm: MpiComm, where: str, body: dict, show: bool = False,
            allow_drop: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Collective: fill the new, empty ``replay`` with the live trajectories of checkpoint ``where``.

    Args:
        replay: a replay just built for the checkpoint's spec and sampler (any ranks and sizes).
        comm: the load's communicator (a :class:`~gear_mpi.checkpoint.arrival.CheckpointComm`
            over the replay's ranks).
        where: the checkpoint directory (resolved).
        body: its manifest body.
        show: whether this rank reports the progress of every rank's reading (:mod:`gear_mpi.progress`).
        allow_drop: keep the newest trajectories that fit when the new shards cannot hold them all
            (otherwise that is an error).
    Returns:
        ``key_map = (old_keys, new_keys)`` sorted by old key (-1: dropped).
    Raises:
        CheckpointError: a file is missing or damaged, or (without ``allow_drop``) the new shards
            cannot hold every trajectory; on every rank (each computes the same deal).
        CollectiveTimeoutError: a rank missed its deadline for its reading (named: absent
            or slow; :mod:`~gear_mpi.checkpoint.arrival`), or did not arrive within the timeout.
        CollectiveError: a rank failed.
    Cost: every rank reads every table; rank r checks the column files of saved
    ranks r, r + size, ...; each rank reads the steps it receives; two agreements
    and one allgatherv of the new keys.
    """
    rank, size = comm.rank, comm.size
    shard = replay.shard
    spec = shard.spec
    saved = range(body["ranks"])
    table_bytes = [shard_files.saved_bytes(body, r, (TABLE, SHARD_JSON)) for r in saved]
    column_bytes = [shard_files.saved_bytes(body, r) - table_bytes[r] for r in saved]
    nbytes = [sum(table_bytes) + sum(column_bytes[r] for r in saved if r % size == q) for q in range(size)]
    err = None
    tables: list[dict] = []
    metas: list[dict] = []
    # every rank's bytes: the check, then the steps dealt (all saved ones, until the deal says how many)
    with Meter(sum(nbytes) + sum(column_bytes), "gear_mpi load (reshard)", show, size) as meter:
        channel = Channel(comm, "load", nbytes, "read", meter)
        try:
            for r in saved:
                meta = shard_files.read_meta(where, body, r)
                metas.append(meta)
                tables.append(shard_files.read_table(where, body, r, meta))
                if r % size == rank:  # this rank checks the columns of saved rank r
                    shard_files.check_columns(where, body, r, meta, spec)
        except Exception as e:
            err = e
        channel.finish(err, "load")
        tag = int(body["tag"])
        allr = _live_records(tables, metas, tag, body["capacity_steps"])
        n = len(allr["key"])
        own = shard.state()
        dest, keep = deal(allr["length"], size, own["capacity_steps"], own["max_items"])
        lost = dropped_error(allr["length"], dest, keep, size, own["capacity_steps"], own["max_items"])
        if lost is not None:  # every rank computed the same deal: the same error everywhere, no message
            if not allow_drop:
                raise lost
            if rank == 0:
                log.warning("load of %s (allow_drop=True): dropped %d of %d trajectories, the oldest that the new "
                            "shards cannot hold", where, int((~keep).sum()), n)
        if own["tag"] == tag:  # the new replay's keys must not be confused with the old ones
            shard.load_state(dict(own, tag=(tag + 1) & keyspace.TAG_MASK))
        steps = np.bincount(dest[keep], weights=allr["length"][keep], minlength=size)
        meter.add_total(int(steps.sum()) * spec.step_bytes - sum(column_bytes))
        ingest = Channel(comm, "load", steps * spec.step_bytes, "read", meter)
        err = None
        mine = np.flatnonzero((dest == rank) & keep)
        new_keys = np.empty(len(mine), np.int64)
        try:
            _insert_from_files(replay, where, metas, allr, mine, new_keys, body)
        except Exception as e:
            err = e
        ingest.finish(err, "load")
    counts = comm.allgather(np.array([len(mine)], np.int64), "load (keys)")[:, 0]
    gathered = comm.allgatherv(new_keys, counts, "load (keys)")
    new_all = np.full(n, -1, np.int64)
    kept_dest = dest[keep]
    kept_idx = np.flatnonzero(keep)
    pos = 0
    for r in range(size):
        idx = kept_idx[kept_dest == r]
        new_all[idx] = gathered[pos:pos + len(idx)]
        pos += len(idx)
    o = np.argsort(allr["key"])
    return allr["key"][o], new_all[o]


def _insert_from_files(replay, where: str, metas: list[dict], allr: dict, mine: np.ndarray,
                       new_keys: np.ndarray, body: dict) -> None:
    """Insert trajectories ``mine`` (indices into ``allr``, oldest first) into this rank's shard,
    in chunks of about :data:`CHUNK_BYTES` of steps, keeping their stamps and times sampled."""
    shard = replay.shard
    spec = shard.spec
    maps: dict[tuple[int, int], np.ndarray] = {}

    def column(r: int, i: int) -> np.ndarray:
        if (r, i) not in maps:
            maps[(r, i)] = shard_files.map_column(where, r, metas[r], i, spec,
                                                   body["shards"][r]["files"])
        return maps[(r, i)]

    limit = max(1, CHUNK_BYTES // max(1, spec.step_bytes))
    pos = 0
    while pos < len(mine):
        end, steps = pos, 0
        while end < len(mine) and (end == pos or steps + allr["length"][mine[end]] <= limit):
            steps += int(allr["length"][mine[end]])
            end += 1
        part = mine[pos:end]
        trajs = []
        for j in part.tolist():
            r, off, length = int(allr["rank"][j]), int(allr["offset"][j]), int(allr["length"][j])
            trajs.append({c.name: column(r, i)(off, length) for i, c in enumerate(spec.columns)})
        keys = replay.insert_many(trajs, allr["priority"][part])
        shard.restore_history(keys, allr["raw_stamp"][part], allr["times"][part])
        progress.advance(steps * spec.step_bytes)
        new_keys[pos:end] = keys
        pos = end
    maps.clear()


def remap(key_map: tuple[np.ndarray, np.ndarray], keys) -> np.ndarray:
    """Translate old keys through ``key_map`` (from :func:`~gear_mpi.checkpoint.load`). Local; O(n log N).

    Args:
        key_map: ``(old_keys, new_keys)`` as load returns it.
        keys: old keys (array-like of int64).
    Returns:
        The new key of each (int64); -1 for keys the map does not hold or that were dropped.
    """
    old, new = key_map
    k = np.asarray(keys, np.int64).reshape(-1)
    if len(old) == 0:
        return np.full(len(k), -1, np.int64)
    i = np.minimum(np.searchsorted(old, k), len(old) - 1)
    return np.where(old[i] == k, new[i], -1)

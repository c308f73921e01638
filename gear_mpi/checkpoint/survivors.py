"""Rebuilding a replay over the ranks that survived a dead one: their shards kept, the dead ranks' restored.

:func:`rebuild` is the data half of ``Replay.recover`` (:mod:`gear_mpi.distributed.recovery` does the
shrink first). On the survivors' new communicator it builds a new replay and fills it with

- every live trajectory of this survivor's own shard, as it is in memory (steps, priority, insertion
  stamp, times sampled): nothing a survivor inserted is lost, whether before or after the checkpoint;
- the live trajectories that the newest checkpoint holds for the *dead* ranks' shards only, dealt over
  the survivors as :func:`~gear_mpi.checkpoint.reshard.deal` deals a reshard (oldest first, each to the
  survivor holding the fewest steps, counting what it already holds).

Both kinds go into the new shard in insertion-stamp order, so FIFO eviction and the ``Fifo``/``Lifo``
selectors see the old order. What is lost is what the dead ranks inserted after the checkpoint began
(and their priority updates and uses since), and nothing else. Keys change (a new key tag, new ranks):
``key_map`` maps the old keys of both kinds.

The checkpoint must be one this replay wrote (the same key tag and number of ranks): its shard ``d`` is
then the dead rank ``d``'s. Without one (``checkpoint=None``) the dead ranks' trajectories are all lost.
"""
from __future__ import annotations

import copy
import hashlib
import os
import time
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..progress import Meter
from . import shard_files
from .arrival import Channel, CheckpointComm
from .files import CHUNK_BYTES, SHARD_JSON, TABLE, read_manifest, resolve
from .protocol import agree_on_manifest, saved_spec as protocol_spec
from .reshard import _live_records, deal

#: the keyword arguments ``Replay.recover`` takes (the rest of ``Replay.load``'s concern the files of a load)
RECOVER_OPTIONS = ("capacity_steps", "max_items", "timeout", "mode", "seed", "memory", "memory_path",
                   "allow_drop", "lazy")


def options(old: Any, survivors: int, overrides: dict) -> dict:
    """The new replay's sizes and settings: ``overrides`` over the old replay's, its per-rank
    ``capacity_steps`` and ``max_items`` grown by ``ranks / survivors`` (rounded up) by default, so that the
    survivors can hold what every rank held. Local, O(1).

    Args:
        old: the replay that lost ranks.
        survivors: how many ranks are left.
        overrides: any of :data:`RECOVER_OPTIONS`.
    Returns:
        Every option, ``capacity_steps``, ``max_items``, ``timeout``, ``mode``, ``allow_drop`` and ``lazy`` set.
    Raises:
        TypeError: an unknown option (the same on every rank: nothing has been touched).
    """
    unknown = sorted(set(overrides) - set(RECOVER_OPTIONS))
    if unknown:
        raise TypeError(f"recover: unexpected keyword argument(s) {unknown}; allowed: {list(RECOVER_OPTIONS)}")
    ranks = old.ranks
    state = old.shard.state()
    out = {"capacity_steps": -(-int(state["capacity_steps"]) * ranks // survivors),
           "max_items": -(-int(state["max_items"]) * ranks // survivors), "timeout": old.comm.timeout,
           "mode": old.mode, "allow_drop": False, "lazy": False}
    out.update(overrides)
    return out


def _read_manifest(checkpoint) -> tuple[dict, str, int]:
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"recover: checkpoint must be a path (str or os.PathLike) or None, got "
                        f"{type(checkpoint).__name__}")
    doc = read_manifest(resolve(os.path.abspath(os.fspath(checkpoint))))
    return doc["body"], doc["path"], int(doc["sha256"][:12], 16)


def _own_records(old: Any) -> dict[str, np.ndarray]:
    """This survivor's live trajectories, oldest first: old key, length, priority, stamp, times sampled."""
    shard = old.shard
    keys = shard.live_keys()
    slots, _ = shard.store.resolve(keys)
    rows = {name: a for name, a in shard.sections() if name in ("stamp", "times_sampled")}
    raw_stamp = rows["stamp"][slots].astype(np.int64)
    times = rows["times_sampled"][slots].astype(np.int64) if "times_sampled" in rows else np.zeros(len(keys), np.int64)
    start, length = shard.locate(keys)
    return {"key": keys, "start": start, "length": length, "priority": shard.priorities(keys), "raw_stamp": raw_stamp,
            "stamp": np.maximum.accumulate(raw_stamp) if len(keys) else raw_stamp, "times": times}


def rebuild(old: Any, comm: Any, survivors: list[int], checkpoint, opts: dict,
            build: Any) -> tuple[Any, tuple[np.ndarray, np.ndarray], dict[str, int]]:
    """Collective over the survivors' communicator ``comm``: a new replay holding every survivor's own shard
    and the dead ranks' shards of ``checkpoint`` (see the module docstring).

    Args:
        old: the replay that lost ranks (open; its shard is read, not changed).
        comm: the survivors' mpi4py communicator (new rank ``i`` was old rank ``survivors[i]``).
        survivors: the old ranks of ``comm``'s ranks.
        checkpoint: a checkpoint directory written by ``old`` (any of its complete ones; the newest loses
            least), or None: the dead ranks' trajectories are lost.
        opts: :func:`options`' result.
        build: the replay class.
    Returns:
        ``(replay, key_map, counts)``: the new replay; ``(old_keys, new_keys)`` sorted by old key, the same on
        every survivor, one entry per kept and per restored trajectory (-1: a restored one dropped with
        ``allow_drop``); ``counts`` (``kept``, ``restored``, ``dropped`` over all survivors, ``seconds``:
        this rank's time reading and inserting).
    Raises:
        CheckpointError: the checkpoint cannot be read, was not written by this replay (another key tag or
            number of ranks), or (without ``allow_drop=True``) the survivors cannot hold every trajectory;
            on every survivor, the new replay closed and ``old`` untouched.
        CollectiveTimeoutError: a survivor did not arrive within the timeout.
        ValueError, MemoryBudgetError, ...: as the Replay constructor (on every survivor).
    Cost: the Replay constructor; every survivor reads the dead ranks' tables (O(their items)); each copies
    its own live steps once (so, until ``old`` closes, its shard's memory twice) and reads the steps it is
    dealt; three small allgathers and one allgatherv of the keys.
    """
    from ..distributed.comm import MpiComm
    t0 = time.monotonic()
    mc = MpiComm(comm, opts["timeout"])
    size = mc.size
    dead = sorted(set(range(old.ranks)) - set(survivors))
    err, body, where, digest = None, None, None, 0
    try:
        if checkpoint is not None:
            body, where, digest = _read_manifest(checkpoint)
            if int(body["ranks"]) != old.ranks or int(body["tag"]) != int(old.shard.tag):
                raise CheckpointError(
                    f"recover: {where} was not written by this replay (it has {body['ranks']} ranks and key tag "
                    f"{body['tag']}; the replay {old.ranks} ranks and tag {old.shard.tag}): pass one of its own "
                    f"checkpoints, or None to go on without the dead ranks' trajectories")
    except Exception as e:
        err = e
    agree_on_manifest(mc, err, digest, "recover (checkpoint)", "survivors", checkpoint)
    own = _own_records(old)
    held = mc.allgather(np.array([int(own["length"].sum()), len(own["key"])], np.int64), "recover (sizes)")
    cap, max_items = int(opts["capacity_steps"]), int(opts["max_items"])
    too_small = [i for i in range(size) if held[i, 0] > cap or held[i, 1] > max_items]
    if too_small:
        i = too_small[0]
        raise CheckpointError(f"recover: survivor {i} holds {held[i, 0]} steps in {held[i, 1]} trajectories, more "
                              f"than capacity_steps={cap}/max_items={max_items}: pass larger ones")
    seed = opts.get("seed")
    if seed is None:  # the same on every survivor: from the old key tag and who survived
        text = f"{int(old.shard.tag)}:{survivors}".encode()
        seed = int(hashlib.sha256(text).hexdigest()[:15], 16)
    kw = dict(mode=opts["mode"], comm=comm, seed=seed, timeout=float(opts["timeout"]), max_items=max_items,
              max_times_sampled=old.shard.max_times_sampled or None, memory=opts.get("memory"),
              force_alltoallv=old.force_alltoallv, lazy=bool(opts["lazy"]), rate_limiter=old.rate_limiter,
              rate_limit_timeout=old.rate_limit_timeout, writer_slack=old._feeds.writer_slack)
    if old.device is not None:
        kw["device"] = old.describe()["device"]
    if opts.get("memory_path") is not None:
        kw["path"] = opts["memory_path"]
    new = build(old.spec, cap, copy.deepcopy(old.selector), **kw)
    ck = None
    try:
        ck = CheckpointComm(new.comm, "recover")
        key_map, counts = _fill(new, old, own, held, ck, body, where, dead, bool(opts["allow_drop"]))
    except BaseException:
        try:
            new.close()
        except Exception:
            pass
        raise
    finally:
        if ck is not None:
            ck.close()
    counts["seconds"] = time.monotonic() - t0
    return new, key_map, counts


def _fill(new: Any, old: Any, own: dict, held: np.ndarray, ck: CheckpointComm, body: dict | None, where: str | None,
          dead: list[int], allow_drop: bool) -> tuple[tuple[np.ndarray, np.ndarray], dict[str, int]]:
    """Collective: insert this survivor's own trajectories and those it is dealt of the dead ranks' saved
    shards into ``new``, in stamp order; the key map and the counts (see :func:`rebuild`)."""
    rank, size = ck.rank, ck.size
    spec = old.spec
    tables, metas, err = [], [], None
    if body is not None:
        table_bytes = sum(shard_files.saved_bytes(body, d, (TABLE, SHARD_JSON)) for d in dead)
        column_bytes = [shard_files.saved_bytes(body, d) - shard_files.saved_bytes(body, d, (TABLE, SHARD_JSON))
                        for d in dead]
        nbytes = [table_bytes + sum(b for j, b in enumerate(column_bytes) if j % size == q) for q in range(size)]
        with Meter(sum(nbytes), "gear_mpi recover", False, size) as meter:
            channel = Channel(ck, "recover", nbytes, "read", meter)
            try:
                for j, d in enumerate(dead):
                    meta = shard_files.read_meta(where, body, d)
                    metas.append(meta)
                    tables.append(shard_files.read_table(where, body, d, meta))
                    if j % size == rank:  # this survivor checks the columns of dead rank d
                        shard_files.check_columns(where, body, d, meta, spec)
            except Exception as e:
                err = e
            channel.finish(err, "recover")
    if tables:
        lost = _live_records(tables, metas, int(body["tag"]), int(body["capacity_steps"]), dead)
    else:
        lost = {k: np.zeros(0, np.float64 if k == "priority" else np.int64)
                for k in ("rank", "slot", "stamp", "raw_stamp", "seq", "length", "priority", "times", "offset", "key")}
    own_state = new.shard.state()
    dest, keep = deal(lost["length"], size, own_state["capacity_steps"], own_state["max_items"], held[:, 0], held[:, 1])
    dropped = int((~keep).sum())
    if dropped and not allow_drop:  # every survivor computed the same deal: the same error everywhere
        need = np.bincount(dest, weights=lost["length"], minlength=size) + held[:, 0]
        items = np.bincount(dest, minlength=size) + held[:, 1]
        raise CheckpointError(
            f"recover: the survivors cannot hold their own {int(held[:, 1].sum())} trajectories and the dead ranks' "
            f"{len(dest)} with capacity_steps={own_state['capacity_steps']}, max_items={own_state['max_items']} "
            f"({dropped} would be dropped): capacity_steps={int(need.max())} and max_items={int(items.max())} per "
            f"rank hold them all; or pass allow_drop=True to drop the oldest of the dead ranks' that do not fit")
    mine = np.flatnonzero((dest == rank) & keep)
    new_own = np.empty(len(own["key"]), np.int64)
    new_lost = np.empty(len(mine), np.int64)
    err = None
    try:
        with old.shard.hold():  # a shard mapping a checkpoint file: raises if another process changed it
            _insert_merged(new, old, own, lost, mine, new_own, new_lost, body, where, metas, dead)
    except Exception as e:
        err = e
    ck.agree(err, "recover (insert)")
    old_keys = np.concatenate([own["key"], lost["key"][mine]])
    new_keys = np.concatenate([new_own, new_lost])
    counts = ck.allgather(np.array([len(old_keys)], np.int64), "recover (keys)")[:, 0]
    old_all = ck.allgatherv(old_keys, counts, "recover (keys)")
    new_all = ck.allgatherv(new_keys, counts, "recover (keys)")
    gone = lost["key"][~keep]
    old_all = np.concatenate([old_all, gone])
    new_all = np.concatenate([new_all, np.full(len(gone), -1, np.int64)])
    o = np.argsort(old_all, kind="stable")
    return (old_all[o], new_all[o]), {"kept": int(held[:, 1].sum()), "restored": int(keep.sum()), "dropped": dropped}


def _insert_merged(new: Any, old: Any, own: dict, lost: dict, mine: np.ndarray, new_own: np.ndarray,
                   new_lost: np.ndarray, body: dict | None, where: str | None, metas: list[dict],
                   dead: list[int]) -> None:
    """Insert this survivor's own trajectories (read from ``old``'s shard) and the dead ranks' ones dealt to it
    (``mine``: indices into ``lost``, read from the checkpoint) into ``new``, merged by insertion stamp, in
    chunks of about :data:`CHUNK_BYTES` of steps; give each its stamp and times sampled back."""
    spec = old.spec
    names = [c.name for c in spec.columns]
    meta_of = dict(zip(dead, metas))
    maps: dict[tuple[int, int], Any] = {}
    saved_index = {name: i for i, name in enumerate(body["column_order"])} if body is not None else {}
    saved_spec = None
    if body is not None:
        saved_spec = protocol_spec(body)

    def column(r: int, name: str):
        i = saved_index[name]
        if (r, i) not in maps:
            maps[(r, i)] = shard_files.map_column(where, r, meta_of[r], i, saved_spec, body["shards"][r]["files"])
        return maps[(r, i)]

    store = old.shard.store
    views = None if spec.compressed else {name: store.columns[name] for name in names}

    def own_steps(j: int) -> dict[str, np.ndarray]:  # views of the ring where it does not wrap: one copy in all
        start, length = int(own["start"][j]), int(own["length"][j])
        if views is None or start + length > store.capacity:
            got = old.shard.get(int(own["key"][j]))
            return {name: got[name] for name in names}
        return {name: v[start:start + length] for name, v in views.items()}

    # one sequence: (stamp, 0 = own / 1 = restored, index), oldest first; own ones keep their own order on ties
    n_own = len(own["key"])
    stamps = np.concatenate([own["stamp"], lost["stamp"][mine]])
    source = np.concatenate([np.zeros(n_own, np.int64), np.ones(len(mine), np.int64)])
    index = np.concatenate([np.arange(n_own), np.arange(len(mine))])
    order = np.lexsort((index, source, stamps))
    lengths = np.concatenate([own["length"], lost["length"][mine]])[order]
    limit = max(1, CHUNK_BYTES // max(1, spec.step_bytes))
    pos = 0
    while pos < len(order):
        end, steps = pos, 0
        while end < len(order) and (end == pos or steps + lengths[end] <= limit):
            steps += int(lengths[end])
            end += 1
        trajs, prios, raw, times = [], [], [], []
        for j in order[pos:end].tolist():
            if j < n_own:
                trajs.append(own_steps(j))
                prios.append(own["priority"][j])
                raw.append(own["raw_stamp"][j])
                times.append(own["times"][j])
            else:
                i = int(mine[j - n_own])
                r, off, length = int(lost["rank"][i]), int(lost["offset"][i]), int(lost["length"][i])
                trajs.append({name: column(r, name)(off, length) for name in names})
                prios.append(lost["priority"][i])
                raw.append(lost["raw_stamp"][i])
                times.append(lost["times"][i])
        keys = new.insert_many(trajs, np.asarray(prios, np.float64))
        new.shard.restore_history(keys, np.asarray(raw, np.int64), np.asarray(times, np.int64))
        for j, key in zip(order[pos:end].tolist(), keys.tolist()):
            if j < n_own:
                new_own[j] = key
            else:
                new_lost[j - n_own] = key
        pos = end
    maps.clear()

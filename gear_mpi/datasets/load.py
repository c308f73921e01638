"""The collective part of every dataset loader: agree on the dataset, build the replay, read each
rank's share of the episodes into it, agree that every rank succeeded.

A *source* (:mod:`.d4rl`, :mod:`.npz`, :mod:`.minari_files`) is opened on every rank and describes the whole
dataset without reading its steps: ``columns`` (name -> (per-step shape, dtype)),
``lengths`` (every episode's steps, in order), ``open_last`` (the last episode has no end)
and ``read(first, stop, buffers)``, which copies the steps of episodes ``first:stop`` into
the front of ``buffers`` (one array per column) and returns views of them.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

from .. import progress as progress_bar
from ..checkpoint.arrival import Channel, CheckpointComm
from ..distributed.comm import MpiComm
from ..replay import Replay
from ..spec import TrajectorySpec, check_count, whole_number
from .episodes import balanced_shares

CHUNK_BYTES = 64 << 20  # steps read and inserted at a time (whole episodes; at least one)


def chunk_bounds(lengths: np.ndarray, step_bytes: int, chunk_bytes: int) -> np.ndarray:
    """Group consecutive episodes into chunks of about ``chunk_bytes`` (whole episodes, at least one
    each). Local, O(E).

    Args:
        lengths: the steps of each episode.
        step_bytes: bytes of one step over all columns.
        chunk_bytes: the target size of one chunk.
    Returns:
        int64 bounds: chunk ``i`` holds episodes ``bounds[i]:bounds[i + 1]``.
    """
    if len(lengths) == 0:
        return np.zeros(1, np.int64)
    first_step = np.cumsum(lengths) - lengths
    group = (first_step * step_bytes) // max(1, int(chunk_bytes))
    cuts = np.flatnonzero(np.diff(group)) + 1
    return np.concatenate([[0], cuts, [len(lengths)]]).astype(np.int64)


def capacity_for(shares: np.ndarray, max_length: int, capacity: int | None, headroom: int | None,
                 rank: int) -> int:
    """The ``capacity_steps`` of a dataset's replay: the given one, else the largest share plus ``headroom``.

    Local, O(ranks).
    Args:
        shares: the steps of each rank's share of the episodes.
        max_length: the spec's max_length.
        capacity: the caller's ``capacity_steps`` (None: sized here).
        headroom: free steps each shard keeps after the load (None: ``max_length``, one more
            episode of the longest length; 0: none, so that the next insert evicts the oldest episode).
        rank: this rank (its share must fit a given capacity).
    Returns:
        The capacity in steps.
    Raises:
        ValueError: ``headroom`` not a non-negative integer, given beside ``capacity``; ``capacity`` not a
            positive integer, or smaller than this rank's share.
    """
    if headroom is not None:
        check_count(headroom, "headroom", least=0, optional=True)
        if capacity is not None:
            raise ValueError(f"give capacity_steps={capacity} or headroom={headroom}, not both (capacity_steps "
                             f"fixes the size; headroom adds free steps to the largest share)")
    if capacity is None:
        free = max_length if headroom is None else int(headroom)
        return max(int(shares.max()), max_length) + free
    capacity = check_count(capacity, "capacity_steps")  # (8.5 was cut to 8; inf raised int()'s OverflowError)
    if int(shares[rank]) > capacity:
        raise ValueError(f"this rank's share of the episodes has {int(shares[rank])} steps, more than "
                         f"capacity_steps={capacity} (leave capacity_steps out to size the replay for it)")
    return capacity


def load_dataset(open_source: Callable[[], Any], what: str, comm, max_length: int | None, progress: bool | None,
                 chunk_bytes: int, replay_kwargs: dict, headroom: int | None = None) -> Replay:
    """Open a dataset on every rank, build a replay sized for it and fill it, each rank with its own share.

    Collective. Every rank opens the source (``open_source()``) and the ranks agree on it; the
    episodes are cut into one contiguous run per rank balanced by steps
    (:func:`~gear_mpi.datasets.episodes.balanced_shares`); the replay is built (its construction
    is collective) with ``capacity_steps`` the largest share plus ``headroom`` unless given
    (:func:`capacity_for`); each rank reads its run in chunks of about ``chunk_bytes`` and
    inserts each with one ``insert_packed``. While reading, the ranks send each other
    heartbeats (:class:`~gear_mpi.checkpoint.arrival.Channel`, on a duplicate of the replay's
    communicator): rank R is waited for ``timeout + bytes_R / rate`` as a checkpoint load
    waits, and rank 0 reports the bytes read by all ranks (:mod:`gear_mpi.progress`: after
    2 s, unless ``progress=False`` or ``GEAR_MPI_PROGRESS=0``). An error on any rank -- the source
    cannot be opened, is damaged or cannot be read, a share that does not fit -- is raised on
    every rank (``"<what>: rank R: ..."``, the class of the lowest failing rank's error), and a
    replay already built is closed first: nothing half-filled is left behind.

    Args:
        open_source: opens the source on this rank.
        what: names the call in errors (``"from_d4rl"``).
        comm: the mpi4py communicator (None: ``MPI.COMM_WORLD``).
        max_length: the spec's max_length (None: the longest episode).
        progress: report progress on rank 0 (None: as :func:`gear_mpi.progress.wanted` decides).
        chunk_bytes: steps read and inserted at a time.
        replay_kwargs: :class:`~gear_mpi.replay.Replay`'s arguments; ``capacity_steps`` among them optional.
        headroom: free steps per shard beyond the largest share (None: ``max_length``); see :func:`capacity_for`.
    Returns:
        The filled replay; ``replay.dataset_info`` (a dict) says what was read: ``source``, ``columns``,
        ``episodes`` and ``steps`` (all ranks), ``open_last_episode``, ``first_episode`` (this rank's
        first, as an index into the dataset's episodes), ``episode_keys`` (the keys of this rank's
        episodes, in dataset order) and ``open_episode_key`` (the open last episode's key on the rank
        holding it, else None).
    Raises:
        ValueError: a missing, damaged or inconsistent dataset, a ``max_length`` that is not a positive
            integer, an episode longer than ``max_length``,
            a share larger than the given ``capacity_steps``, or a bad ``headroom`` (on every rank).
        TypeError: ``progress`` not None or a bool (on every rank).
        ImportError: a module the source needs is missing (on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``, or missed its deadline for
            its reading (named: absent or slow).
    """
    replay_kwargs = dict(replay_kwargs)
    capacity = replay_kwargs.pop("capacity_steps", None)
    mc = MpiComm(comm, replay_kwargs.get("timeout", 60.0))
    source, err = None, None
    try:
        show = progress_bar.wanted(progress, mc.rank)
        source = open_source()
        lengths = np.asarray(source.lengths, np.int64)
        longest = int(lengths.max()) if len(lengths) else 1
        if max_length is not None and not whole_number(max_length):
            raise ValueError(f"max_length must be a positive integer (or None: the longest episode), "
                             f"got {max_length!r}")
        max_length = longest if max_length is None else int(max_length)
        if longest > max_length:
            e = int(np.argmax(lengths))
            raise ValueError(f"episode {e} has {longest} steps, more than max_length={max_length}")
        spec = TrajectorySpec(source.columns, max_length)
        bounds = balanced_shares(lengths, mc.size)
        shares = np.add.reduceat(np.append(lengths, 0), bounds[:-1]) * (np.diff(bounds) > 0)
        capacity = capacity_for(shares, max_length, capacity, headroom, mc.rank)
    except Exception as e:  # noqa: BLE001 -- agreed, then raised on every rank
        err = e
    try:
        mc.agree(err, what)
        mc.agree_signature({"spec": spec.to_dict(), "episode lengths": hashlib.sha256(lengths.tobytes()).hexdigest(),
                            "open last episode": source.open_last}, f"{what} (dataset)",
                           "every rank must see the same dataset")
    except BaseException:
        if source is not None:
            source.close()
        raise
    try:
        replay = Replay(spec, int(capacity), comm=mc.comm, **replay_kwargs)
    except BaseException:
        source.close()
        raise
    first, stop = int(bounds[mc.rank]), int(bounds[mc.rank + 1])
    keys = np.zeros(0, np.int64)
    nbytes = shares * spec.step_bytes
    ck = None
    try:
        ck = CheckpointComm(replay.comm, what)
        with progress_bar.Meter(int(nbytes.sum()), f"gear_mpi {what}", show, mc.size) as meter:
            channel = Channel(ck, what, nbytes, "read", meter)
            err = None
            try:
                keys = _fill(replay, source, lengths[first:stop], first, meter, chunk_bytes)
            except Exception as e:  # noqa: BLE001 -- agreed, then raised on every rank
                err = e
            finally:
                source.close()
            channel.finish(err, f"{what} (read)")
    except BaseException:
        source.close()
        replay.close()
        raise
    finally:
        if ck is not None:
            ck.close()
    n_episodes = len(lengths)
    holds_open = source.open_last and stop == n_episodes and stop > first
    replay.dataset_info = {
        "source": source.description, "columns": list(spec.names), "episodes": n_episodes,
        "steps": int(lengths.sum()), "open_last_episode": bool(source.open_last), "first_episode": first,
        "episode_keys": keys, "open_episode_key": int(keys[-1]) if holds_open else None,
    }
    return replay


def _fill(replay: Replay, source, lengths: np.ndarray, first: int, meter: progress_bar.Meter,
          chunk_bytes: int) -> np.ndarray:
    """Read episodes ``first:first + len(lengths)`` of ``source`` chunk by chunk into ``replay``, counting
    the bytes on ``meter``. Local."""
    spec = replay.spec
    bounds = chunk_bounds(lengths, spec.step_bytes, chunk_bytes)
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    cum = np.concatenate([[0], np.cumsum(lengths)])
    rows = int(np.max(cum[bounds[1:]] - cum[bounds[:-1]]))
    buffers = {c.name: np.empty((rows,) + c.shape, c.dtype) for c in spec.columns}  # reused by every chunk
    keys = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        columns = source.read(first + int(a), first + int(b), buffers)
        keys.append(replay.insert_packed(columns, lengths[a:b]))
        meter.advance(int(cum[b] - cum[a]) * spec.step_bytes)
    return np.concatenate(keys)

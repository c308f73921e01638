"""The collective part of every dataset loader: agree on the dataset, build the replay, read each
rank's share of the episodes into it, agree that every rank succeeded.

A *source* (:mod:`.d4rl`, :mod:`.npz`) is opened on every rank and describes the whole
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
from ..distributed.comm import MpiComm
from ..replay import Replay
from ..spec import TrajectorySpec
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


def load_dataset(open_source: Callable[[], Any], what: str, comm, max_length: int | None, progress: bool | None,
                 chunk_bytes: int, replay_kwargs: dict) -> Replay:
    """Open a dataset on every rank, build a replay sized for it and fill it, each rank with its own share.

    Collective. Every rank opens the source (``open_source()``) and the ranks agree on it; the
    episodes are cut into one contiguous run per rank balanced by steps
    (:func:`~gear_mpi.datasets.episodes.balanced_shares`); the replay is built (its construction
    is collective) with ``capacity_steps`` the largest share unless given; each rank reads its
    run in chunks of about ``chunk_bytes`` and inserts each with one ``insert_packed``; a tqdm
    bar (:mod:`gear_mpi.progress`) counts rank 0's bytes. An error on any rank -- the source
    cannot be opened, is damaged or cannot be read, a share that does not fit -- is raised on
    every rank (``"<what>: rank R: ..."``, the class of the lowest failing rank's error), and a
    replay already built is closed first: nothing half-filled is left behind.

    Args:
        open_source: opens the source on this rank.
        what: names the call in errors (``"from_d4rl"``).
        comm: the mpi4py communicator (None: ``MPI.COMM_WORLD``).
        max_length: the spec's max_length (None: the longest episode).
        progress: show a bar (None: as :func:`gear_mpi.progress.wanted` decides).
        chunk_bytes: steps read and inserted at a time.
        replay_kwargs: :class:`~gear_mpi.replay.Replay`'s arguments; ``capacity_steps`` among them optional.
    Returns:
        The filled replay; ``replay.dataset_info`` (a dict) says what was read: ``source``, ``columns``,
        ``episodes`` and ``steps`` (all ranks), ``open_last_episode``, ``first_episode`` (this rank's
        first, as an index into the dataset's episodes), ``episode_keys`` (the keys of this rank's
        episodes, in dataset order) and ``open_episode_key`` (the open last episode's key on the rank
        holding it, else None).
    Raises:
        ValueError: a missing, damaged or inconsistent dataset, an episode longer than ``max_length``,
            or a share larger than the given ``capacity_steps`` (on every rank).
        ImportError: a module the source needs is missing (on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    """
    replay_kwargs = dict(replay_kwargs)
    capacity = replay_kwargs.pop("capacity_steps", None)
    mc = MpiComm(comm, replay_kwargs.get("timeout", 60.0))
    source, err = None, None
    try:
        source = open_source()
        lengths = np.asarray(source.lengths, np.int64)
        longest = int(lengths.max()) if len(lengths) else 1
        max_length = longest if max_length is None else int(max_length)
        if longest > max_length:
            e = int(np.argmax(lengths))
            raise ValueError(f"episode {e} has {longest} steps, more than max_length={max_length}")
        spec = TrajectorySpec(source.columns, max_length)
        bounds = balanced_shares(lengths, mc.size)
        shares = np.add.reduceat(np.append(lengths, 0), bounds[:-1]) * (np.diff(bounds) > 0)
        if capacity is None:
            capacity = max(int(shares.max()), max_length)
        elif int(shares[mc.rank]) > int(capacity):
            raise ValueError(f"this rank's share of the episodes has {int(shares[mc.rank])} steps, more than "
                             f"capacity_steps={capacity} (leave capacity_steps out to size the replay for it)")
    except Exception as e:  # noqa: BLE001 -- agreed, then raised on every rank
        err = e
    try:
        mc.agree(err, what)
        mc.agree_signature(repr((spec.to_dict(), hashlib.sha256(lengths.tobytes()).hexdigest(), source.open_last)),
                           f"{what} (dataset)", "every rank must see the same dataset")
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
    err = None
    try:
        keys = _fill(replay, source, lengths[first:stop], first, what, progress, chunk_bytes)
    except Exception as e:  # noqa: BLE001 -- agreed, then raised on every rank
        err = e
    finally:
        source.close()
    try:
        mc.agree(err, f"{what} (read)")
    except BaseException:
        replay.close()
        raise
    n_episodes = len(lengths)
    holds_open = source.open_last and stop == n_episodes and stop > first
    replay.dataset_info = {
        "source": source.description, "columns": list(spec.names), "episodes": n_episodes,
        "steps": int(lengths.sum()), "open_last_episode": bool(source.open_last), "first_episode": first,
        "episode_keys": keys, "open_episode_key": int(keys[-1]) if holds_open else None,
    }
    return replay


def _fill(replay: Replay, source, lengths: np.ndarray, first: int, what: str, progress: bool | None,
          chunk_bytes: int) -> np.ndarray:
    """Read episodes ``first:first + len(lengths)`` of ``source`` chunk by chunk into ``replay``. Local."""
    spec = replay.spec
    bounds = chunk_bounds(lengths, spec.step_bytes, chunk_bytes)
    if len(lengths) == 0:
        return np.zeros(0, np.int64)
    cum = np.concatenate([[0], np.cumsum(lengths)])
    rows = int(np.max(cum[bounds[1:]] - cum[bounds[:-1]]))
    buffers = {c.name: np.empty((rows,) + c.shape, c.dtype) for c in spec.columns}  # reused by every chunk
    keys = []
    show = progress_bar.wanted(progress, replay.rank)
    with progress_bar.Meter(int(cum[-1]) * spec.step_bytes, f"gear_mpi {what}", show) as meter:
        for a, b in zip(bounds[:-1], bounds[1:]):
            columns = source.read(first + int(a), first + int(b), buffers)
            keys.append(replay.insert_packed(columns, lengths[a:b]))
            meter.advance(int(cum[b] - cum[a]) * spec.step_bytes)
    return np.concatenate(keys)

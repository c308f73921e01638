"""Episodes of a flat step table, and each rank's share of them. Pure numpy, local, no I/O.

A dataset in the D4RL layout is one table of ``N`` steps; an episode ends at a step whose
``terminals`` or ``timeouts`` flag is set. :func:`split_episodes` finds the episodes
(steps after the last end form one more, *open*, episode); :func:`balanced_shares` cuts the
episode sequence into one contiguous run per rank with about the same number of steps.
"""
from __future__ import annotations

import numpy as np


def split_episodes(terminals: np.ndarray, timeouts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """The episodes of a step table. Local, O(N), vectorized.

    Args:
        terminals: ``N`` flags (any numeric or bool dtype: nonzero ends an episode).
        timeouts: ``N`` flags likewise, or None.
    Returns:
        ``(starts, lengths, open_last)``: int64 first step and length of each episode in order,
        and whether the last one has no end flag (the table stops inside it).
    Raises:
        ValueError: the flags are not 1-D, or differ in length.
    """
    ends = np.asarray(terminals).reshape(-1) != 0
    if np.ndim(terminals) != 1:
        raise ValueError(f"terminals must be 1-D, got shape {np.shape(terminals)}")
    if timeouts is not None:
        if np.ndim(timeouts) != 1 or len(timeouts) != len(ends):
            raise ValueError(f"timeouts has shape {np.shape(timeouts)}, terminals {np.shape(terminals)}")
        ends |= np.asarray(timeouts) != 0
    n = len(ends)
    last = np.flatnonzero(ends)
    open_last = n > 0 and (len(last) == 0 or last[-1] != n - 1)
    stops = np.append(last + 1, n) if open_last else last + 1
    starts = np.concatenate([[0], stops])[:len(stops)].astype(np.int64)
    return starts, (stops - starts).astype(np.int64), bool(open_last)


def balanced_shares(lengths: np.ndarray, ranks: int) -> np.ndarray:
    """Cut a sequence of episodes into ``ranks`` contiguous runs of about equal steps. Local, O(E).

    Episode ``e`` goes to the rank whose run of steps ``[r T / ranks, (r + 1) T / ranks)`` holds
    its middle step (``T``: all steps), so each run is within one episode of ``T / ranks``.

    Args:
        lengths: the steps of each episode, in order.
        ranks: how many runs.
    Returns:
        ``bounds``, int64 ``[ranks + 1]``: rank ``r`` gets episodes ``bounds[r]:bounds[r + 1]``.
    """
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(ranks + 1, np.int64)
    middles = np.cumsum(lengths) - (lengths + 1) // 2  # start + floor(length / 2), in integers
    owner = (middles * ranks) // total  # in [0, ranks)
    return np.searchsorted(owner, np.arange(ranks + 1), side="left").astype(np.int64)

"""A sample's header: the row every rank gives ``Replay.sample``'s first collective, defined, built, agreed
and checked here.

The header is a ``[ranks, HEADER_WIDTH]`` float64 table, row r from rank r (the values of the sample's head,
:mod:`gear_mpi.distributed.calls`, which adds a status and the call), with the columns:

- ``BATCH``, ``WINDOW``, ``ALIGN``, ``MODE``: the call's arguments (the align code; the mode's index in
  :data:`MODES`);
- ``MASS``, ``ITEMS``, ``MIN_WEIGHT``: the rank's shard: its selection mass, live items and smallest weight;
- ``INSERTED``, ``SAMPLED``, ``BACKLOG``, ``WAITED``: the rate limiter's counts (items ever inserted, windows
  ever served, episodes waiting in the rank's writers, seconds this call has waited;
  :mod:`gear_mpi.feeds.replay_feeds` reads them);
- ``CHECKPOINT``: 1 when the rank's background checkpoints (:mod:`gear_mpi.checkpoint.background`) are due
  and its previous one is written, else 0; a checkpoint starts after the sample when every rank says 1.

:func:`agree` builds this rank's row (:func:`build_row`) and agrees it as a ``"sample"`` head -- one
allgather over the communicator, or the node board's shared memory when every rank is on one node -- repeating while
the rate limiter holds the call; :func:`check_mode` and :func:`check_header` then raise the same
error on every rank when the agreed call cannot be served. The plans of
:mod:`gear_mpi.distributed.plans` turn the agreed header into who serves whom.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import EmptyReplayError
from ..kernels import ring

BATCH, WINDOW, ALIGN, MASS, ITEMS, MIN_WEIGHT, MODE, INSERTED, SAMPLED, BACKLOG, WAITED, CHECKPOINT = range(12)
HEADER_WIDTH = 12
MODES = ("decentralized", "centralized", "local")


def mode_code(mode: str) -> int:
    """The header code of a sampling mode (its index in :data:`MODES`). O(1), local.

    Args:
        mode: one of :data:`MODES`.
    Returns:
        Its index in :data:`MODES`.
    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return MODES.index(mode)


def build_row(shard, batch_size: int, window: int, code: int, mcode: int, backlog: int, waited: float,
              checkpoint: float = 0.0) -> list[float]:
    """This rank's row of the header (local, O(1)).

    Args:
        shard: this rank's :class:`~gear_mpi.shard.Shard` (its mass, live items, smallest weight and counters).
        batch_size, window, code, mcode: the call's batch size, window, align code and mode code.
        backlog: episodes waiting in this rank's writers (0 without a rate limiter); waited: seconds this
            call has waited for the rate limiter; checkpoint: the rank's vote for a background checkpoint.
    Returns:
        ``HEADER_WIDTH`` numbers in column order.
    """
    return [batch_size, window, code, shard.total_weight, len(shard), shard.min_weight, mcode,
            float(shard.store.state[ring.INSERTED_TOTAL]), float(shard.samples_drawn), float(backlog), waited,
            checkpoint]


def agree(feeds, shard, calls, err: BaseException | None, batch_size: int, window: int, code: int,
          mcode: int, checkpoint: float = 0.0) -> np.ndarray:
    """The sample's agreed header, once the rate limiter admits the call.

    Each round drains the writers (``feeds.feed()``; its error is agreed like ``err``), builds this rank's
    row and agrees it; ``feeds.admit(head)`` decides from the agreed table -- alike on every rank -- whether
    the call runs now; if not, every rank backs off (``feeds.back_off``) and agrees again.

    Collective over ``calls`` (one head a round, :mod:`gear_mpi.distributed.calls`: an allgather, or a row
    on the node board; none when ``calls`` is None).
    Args:
        feeds: the replay's :class:`~gear_mpi.feeds.replay_feeds.ReplayFeeds`; shard: this rank's shard.
        calls: the replay's :class:`~gear_mpi.distributed.calls.ReplayCalls` (each round is a ``"sample"``
            head, the row its values), or None for this rank's row alone (a local sample).
        err: this rank's error with the call's arguments (then the other arguments are 0), or None.
        batch_size, window, code, mcode, checkpoint: as :func:`build_row`.
    Returns:
        ``[ranks, HEADER_WIDTH]`` float64 (``[1, HEADER_WIDTH]``: this rank's row, when ``calls`` is None).
    Raises:
        the lowest failing rank's error, on every rank (with ``comm`` None: this rank's);
        ValueError, RateLimitTimeoutError: from ``feeds.admit``; CollectiveTimeoutError: a rank did not arrive;
        CollectiveError: another rank is in another call (:mod:`gear_mpi.distributed.calls`).
    """
    start, rounds = time.monotonic(), 0
    while True:
        backlog = 0
        try:
            feeds.feed()
            backlog = feeds.header_backlog()  # (an inbox probe: MPI)
        except Exception as e:  # agreed below, so every rank raises it
            err = err or e
        row = build_row(shard, batch_size, window, code, mcode, backlog, time.monotonic() - start, checkpoint)
        if calls is None:
            if err is not None:
                raise err
            head = np.array(row, np.float64)[None]
        else:
            head = calls.agree(err, "sample", row)
        if feeds.admit(head):
            return head
        feeds.back_off(rounds)
        rounds += 1


def check_mode(head: np.ndarray) -> str:
    """The mode every rank asked for in the agreed header. O(ranks), local; the same on every rank.

    Args:
        head: the agreed header (``[ranks, HEADER_WIDTH]`` float64).
    Returns:
        The mode's name.
    Raises:
        ValueError: the ranks asked for different modes (the same message on every rank).
    """
    codes = [int(c) for c in head[:, MODE].tolist()]
    if len(set(codes)) > 1:
        raise ValueError(f"sample: mode must be the same on every rank; got {[MODES[c] for c in codes]} "
                         f"(rank r's mode at position r)")
    return MODES[codes[0]]


def check_header(head: np.ndarray, proportional: bool) -> None:
    """Raise the same error on every rank when the agreed header cannot be served. O(ranks), local.

    Args:
        head: the agreed header (``[ranks, HEADER_WIDTH]`` float64, a row per rank; see the module docstring).
        proportional: whether the selector draws by weight (then a zero total mass cannot be served).
    Raises:
        ValueError: window or align differ between ranks.
        EmptyReplayError: items are asked and no rank holds one (or, for proportional selectors,
            every live item has priority 0).
    """
    windows, codes = head[:, WINDOW].tolist(), head[:, ALIGN].tolist()
    if len(set(windows)) > 1 or len(set(codes)) > 1:
        raise ValueError(f"sample: window and align must be the same on every rank; got windows "
                         f"{[int(w) for w in windows]} and align codes {[int(c) for c in codes]}")
    wanted = sum(head[:, BATCH].tolist()) > 0
    if wanted and sum(head[:, ITEMS].tolist()) == 0:
        raise EmptyReplayError("sample: the replay is empty on every rank")
    if wanted and proportional and sum(head[:, MASS].tolist()) <= 0.0:
        raise EmptyReplayError("sample: every live item of the replay has priority 0")

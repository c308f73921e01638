"""A Replay's constructor arguments: checked on each rank, then agreed, so that a bad one on any rank raises the
same error on every rank at once (instead of the others waiting for it until ``timeout``).

The checks here are those a rank can make alone (the values, not whether the ranks passed the same ones:
``MpiComm.agree_signature`` does that next). Their agreement is the construction's first collective.
"""
from __future__ import annotations

from ..feeds.replay_feeds import check_rate_limit
from ..keys import MAX_RANKS
from ..spec import TrajectorySpec
from ..storage.arenas import memory_kind
from ..storage.device import parse_device
from .comm import MpiComm, with_deadline
from .header import mode_code


def check(spec, mode, window_transport, rate_limiter, rate_limit_timeout, writer_slack, device, memory,
          size: int) -> tuple[str, str | None]:
    """This rank's checks of the arguments but ``timeout`` (:func:`agree` checks it first: it is the
    agreement's own deadline). Local, O(1).

    Returns:
        ``(device kind, memory kind or None)``: ``parse_device``'s kind and ``memory_kind``'s reading of ``memory``.
    Raises:
        TypeError: ``spec`` is not a TrajectorySpec, ``device`` not a string, or ``rate_limiter`` not a limiter.
        ValueError: an unknown ``mode``, ``window_transport``, ``device`` or ``memory``; a
            ``rate_limit_timeout`` that is not a positive number; a bad ``writer_slack``; more ranks than keys
            can name; derived columns on a device replay.
    """
    if not isinstance(spec, TrajectorySpec):
        raise TypeError(f"spec must be a TrajectorySpec, got {type(spec).__name__}")
    mode_code(mode)  # ValueError for an unknown mode
    if window_transport not in ("nccl", "mpi"):
        raise ValueError(f"window_transport must be 'nccl' or 'mpi', got {window_transport!r}")
    check_rate_limit(rate_limiter, rate_limit_timeout, writer_slack)
    if size > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} ranks are supported, got {size}")
    device_kind, _ = parse_device(device)
    if device_kind == "cuda" and spec.derived:
        raise ValueError("derived columns (FrameStack, NextStep) are rebuilt on the host: use device='cpu' "
                         "and move the batch (batch.to(...)), or store the columns")
    if memory is not None:
        memory = memory_kind(memory, stacklevel=5)  # the DeprecationWarning points at the Replay(...) call
    return device_kind, memory


def agree(comm, timeout, what: str, **args) -> tuple[MpiComm, str, str | None]:
    """Collective: :func:`check` on every rank, its failure agreed (one allgather of 8 bytes a rank, +1 KiB
    when a rank failed).

    Args:
        comm: the mpi4py communicator (None: ``MPI.COMM_WORLD``); timeout: the replay's deadline.
        what: names the call in errors; args: :func:`check`'s other arguments, by name (``size`` is the comm's).
    Returns:
        ``(MpiComm over comm with the deadline timeout, device kind, memory kind or None)``.
    Raises:
        TypeError, ValueError: a bad argument on some rank, on every rank: ``"<what>: rank R: <message>"``.
        CollectiveTimeoutError: a rank did not arrive within the deadline.
    """
    mpi, err = with_deadline(comm, timeout)
    found = ("cpu", None)
    if err is None:
        try:
            found = check(size=mpi.size, **args)
        except (TypeError, ValueError) as e:
            err = e
    mpi.agree(err, what)
    return (mpi, *found)

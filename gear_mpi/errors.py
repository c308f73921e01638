"""Exceptions raised by gear_mpi. Each message names the column, key or argument at fault."""
from __future__ import annotations

#: appended to timeout messages: the usual reason a rank never arrives, and the way to end such a job at once
ABORT_HINT = ("; if another rank stopped on an exception, run the job as `mpiexec ... python -m mpi4py "
              "script.py`, which aborts every rank at once instead of leaving the others to wait")


class GearError(Exception):
    """Base class of every gear_mpi error."""


class InvalidTrajectoryError(GearError, ValueError):
    """A trajectory does not match the spec (column, dtype, shape or length)."""


class InvalidPriorityError(GearError, ValueError):
    """A priority is NaN, infinite or negative, or the priorities do not match the items."""


class InvalidKeyError(GearError, ValueError):
    """A key that no replay of this kind could have issued (another replay's, or malformed)."""


class StaleKeyError(GearError, KeyError):
    """A key whose trajectory has been evicted or removed since it was issued."""

    def __str__(self) -> str:  # the message as written (KeyError's str() quotes it, as it would a missing key)
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class EmptyReplayError(GearError, RuntimeError):
    """Sampling was asked of a replay that holds nothing it can select."""


class CollectiveError(GearError, RuntimeError):
    """A collective call failed on some rank, or the ranks are in different collective calls ("collective
    mismatch: rank 0 called update_priorities (call #7), rank 1 called stats (call #7); ..."); raised on
    every rank with the same message. After a mismatch (or a timeout) the replay is unusable: later calls
    raise CollectiveError at once."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A rank did not reach a collective call within the replay's timeout."""


class CheckpointError(GearError, RuntimeError):
    """A checkpoint is missing, partial, corrupted or of another format, or (``load(mmap=True)``) another
    process wrote or truncated a file the replay maps; the message names the file."""


class RateLimitTimeoutError(GearError, TimeoutError):
    """A sample waited longer than the replay's ``rate_limit_timeout`` for its rate limiter to allow it;
    raised on every rank alike, and the replay stays usable."""


class WriterError(GearError, RuntimeError):
    """A writer cannot go on: its replay was closed, its owner process died, or it was itself closed."""


class WriterTimeoutError(WriterError, TimeoutError):
    """A writer waited longer than its ``timeout`` for room in its staging area (backpressure)."""


class MemoryBudgetError(GearError, MemoryError):
    """The node cannot give the memory a replay asks for (RAM, a cgroup limit, or /dev/shm); raised at
    construction on every rank, naming the sizes and the ways out."""


class StorageError(GearError, OSError):
    """A file-backed shard's files cannot be made: ``path`` missing, not a directory or not
    writable, a file in the way, or not enough disk (checked when the shard is built)."""


class RecoveryError(CollectiveError):
    """``Replay.recover`` cannot survive a dead rank here: the MPI library has no ULFM (MPICH, or Open MPI
    started without ``mpiexec --with-ft ulfm``), or the survivors did not all call it; restart the job from
    the newest checkpoint instead (``Replay.load``; docs/guide/faults.md)."""


class CorruptDataError(GearError, ValueError):
    """Stored data failed its check: a compressed chunk (:class:`gear_mpi.Compressed` columns) whose bytes do
    not match their CRC-32 or do not decompress; the message names the column, the chunk's ring steps and
    the trajectories they hold. Nothing wrong is returned."""


def not_copyable(what: str, instead: str):
    """A ``__reduce_ex__`` for an object that owns something live (an MPI communicator, a thread, a mapping
    of another process's memory): ``pickle``, ``copy.copy`` and ``copy.deepcopy`` raise a TypeError naming
    ``what`` and what to do ``instead``, rather than numpy's or mpi4py's "cannot pickle ..." or a shallow copy
    that shares the live part (whose closing, or garbage collection, then acts on the original). O(1).

    Args:
        what: the object, for the message (e.g. ``"a Replay (its shards live on MPI ranks)"``).
        instead: what to use instead.
    Returns:
        The method, to assign as ``__reduce_ex__`` in the class body.
    """
    def __reduce_ex__(self, protocol):
        raise TypeError(f"{what} cannot be pickled or copied: {instead}")
    return __reduce_ex__

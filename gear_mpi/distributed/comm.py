"""The communicator layer: collectives with a deadline and errors agreed by every rank.

:class:`MpiComm` wraps an mpi4py communicator. Every collective is posted
non-blocking and polled until it completes or ``timeout`` seconds pass, so a
rank that never arrives is reported (``CollectiveTimeoutError``) instead of
waited on forever. That includes the steps of construction:
:meth:`MpiComm.agree_signature` (argument digests), :meth:`MpiComm.split_node`
(the node split, behind an Ibarrier), :meth:`MpiComm.bcast` and
:meth:`MpiComm.allgather_bytes`. After a timeout the communicator holds a
pending request and is marked broken: later calls raise at once, also through
any MpiComm built on the same communicator later (:mod:`gear_mpi.distributed.deadline`).

:meth:`MpiComm.agree` turns a local exception into the same exception on every
rank: it costs one allgather of an 8-byte status, plus one allgather of the
messages when some rank failed.
"""
from __future__ import annotations

import hashlib
import time
from itertools import accumulate
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import deadline
from .. import errors

DEFAULT_TIMEOUT = 60.0  # the deadline of an agreement whose own ``timeout`` argument was the bad one


def check_timeout(timeout, name: str = "timeout", optional: bool = False) -> None:
    """Raises ValueError unless ``timeout`` is a positive number of seconds (not a bool: ``True`` is no time; with
    ``optional``, None too). ``name`` is the argument's name in the message. O(1)."""
    if optional and timeout is None:
        return
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"{name} must be {'None or ' if optional else ''}a positive number of seconds, "
                         f"got {timeout!r}")


def with_deadline(comm, timeout: Any) -> tuple["MpiComm", ValueError | None]:
    """The :class:`MpiComm` of a collective call that takes a ``timeout`` argument, and that argument's error.

    Args:
        comm: an mpi4py communicator (None: ``MPI.COMM_WORLD``); timeout: the caller's deadline, unchecked.
    Returns:
        ``(MpiComm(comm, timeout), None)``; for a timeout that is not a positive number, ``(MpiComm(comm,
        DEFAULT_TIMEOUT), its ValueError)``, for the caller's first agreement to raise on every rank (instead of
        every rank timing out at once under a deadline of 0, or one rank failing alone). Local, O(1).
    """
    try:
        check_timeout(timeout)
    except ValueError as e:
        return MpiComm(comm, DEFAULT_TIMEOUT), e
    return MpiComm(comm, timeout), None

#: the error classes an agreement carries (by index; a rank's error is sent as its most specific class here and
#: raised as that class on every rank): Python's common ones, then gear_mpi's; a class comes after its bases
_ERROR_CODES: list[type[Exception]] = [
    Exception, RuntimeError, NotImplementedError, OSError, ArithmeticError, OverflowError, ZeroDivisionError,
    IndexError, ValueError, TypeError, KeyError, errors.InvalidTrajectoryError, errors.InvalidPriorityError,
    errors.InvalidKeyError, errors.StaleKeyError, errors.EmptyReplayError, errors.CollectiveError,
    errors.CheckpointError, errors.WriterError, MemoryError, errors.MemoryBudgetError, errors.StorageError,
    errors.CorruptDataError,
]
MESSAGE_BYTES = 1024
FIELD_TEXT = 240  # bytes of a field's value an agree_signature error shows (longer values are cut with "...")


def _clip(text: str) -> bytes:
    """``text`` as at most FIELD_TEXT bytes of UTF-8 (no unit separator, cut with "..." when longer)."""
    data = text.replace("\x1f", " ").encode("utf-8", "replace")
    if len(data) <= FIELD_TEXT:
        return data
    return data[:FIELD_TEXT - 3].decode("utf-8", "ignore").encode() + b"..."


def error_code(exc: BaseException, classes: Sequence[type] | None = None) -> int:
    """The status :meth:`MpiComm.agree` sends for ``exc``: the index of its most specific class in
    ``classes`` (later entries more specific; None: the table of agreed error classes), 0 when none but the
    first fits. Local, O(classes)."""
    best = 0
    for i, cls in enumerate(_ERROR_CODES if classes is None else classes):
        if isinstance(exc, cls):
            best = i  # later entries are more specific
    return best


def differing_ranks(column) -> list[int]:
    """The ranks whose entry in ``column`` (one value per rank, from an agreed table) differs from rank 0's: the
    same list on every rank, for an error that names them. Local, O(ranks)."""
    column = np.asarray(column)
    return np.flatnonzero(column != column[0]).tolist()


def message_bytes(error: BaseException | None, size: int = MESSAGE_BYTES) -> np.ndarray:
    """``str(error)`` as UTF-8 in a zero-padded uint8 array of ``size`` bytes (cut there; all zeros for None),
    for a collective that sends a rank's error to the others. Local, O(size)."""
    buf = np.zeros(size, np.uint8)
    if error is not None:
        data = str(error).encode("utf-8", "replace")[:size]
        buf[:len(data)] = np.frombuffer(data, np.uint8)
    return buf


def message_text(buf: np.ndarray) -> str:
    """The text :func:`message_bytes` packed (any array over those bytes), KeyError's repr quotes taken off.
    Local, O(size)."""
    text = np.asarray(buf).view(np.uint8).tobytes().rstrip(b"\0").decode("utf-8", "replace")
    return text[1:-1] if text.startswith("'") and text.endswith("'") else text


_MPI = None


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


def displacements(counts) -> np.ndarray:
    """Returns where each part starts when parts of ``counts`` elements lie one after another: the
    exclusive prefix sum ``[0, c0, c0 + c1, ...]`` (int64, same length as ``counts``). O(len).

    Args:
        counts: the parts' sizes.
    """
    counts = np.asarray(counts, np.int64)
    return np.cumsum(counts) - counts


_TYPES: dict = {}


def mpi_type(dtype) -> Any:
    """Returns the ``MPI.Datatype`` of a numpy dtype (mpi4py's public mapping). O(1) after the first call.

    Args:
        dtype: anything ``np.dtype`` takes.
    Raises:
        ValueError: a dtype MPI has no datatype for.
    """
    dtype = np.dtype(dtype)
    found = _TYPES.get(dtype)
    if found is None:
        from mpi4py.util.dtlib import from_numpy_dtype
        found = _TYPES[dtype] = from_numpy_dtype(dtype)
    return found


class MpiComm:
    """Collectives over an mpi4py communicator with a deadline of ``timeout`` seconds per call.

    Costs are those of the MPI collective; the polling loop adds at most ~1 ms of latency. Every
    collective must be called by every rank, in the same order; ``what`` names the call in errors.
    Args:
        comm: an mpi4py communicator (None: ``MPI.COMM_WORLD``).
        timeout: seconds each collective may wait for the slowest rank.
    """

    def __init__(self, comm=None, timeout: float = 60.0):
        MPI = _mpi()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = float(timeout)
        self.broken: str | None = deadline.pending_reason(self.comm)
        self.waited = 0.0  # seconds spent in wait() (gear_mpi.stats)

    # ---- waiting ----------------------------------------------------------------------
    def wait(self, req, what: str) -> None:
        """Poll ``req`` until done (:func:`gear_mpi.distributed.deadline.poll`: yielding the core, then sleeping up to 1 ms).

        Args:
            req: an mpi4py request (anything with ``Test()``).
            what: names the call in the error.
        Raises:
            CollectiveTimeoutError: a rank did not arrive in time or the ranks are out of step (deadline.finish);
                the communicator is then broken, for every MpiComm built on it later too (deadline.mark_pending),
                and ``req`` is kept with its buffers (deadline.keep_pending), as after an interrupt.
        """
        start = time.perf_counter()
        try:
            cause = deadline.finish(req, self.timeout, self.size, _mpi().Exception)
        except errors.GearError:  # raised on purpose by a test it polls (a checkpoint peer gave up): as before
            raise
        except BaseException as e:  # e.g. KeyboardInterrupt: the collective stays pending, the ranks out of step
            deadline.keep_pending(req)  # (its buffers: MPI may still write into them)
            self.interrupted(what, e)
            raise
        if cause is None:
            self.waited += time.perf_counter() - start
            return
        deadline.keep_pending(req)
        self.broken = (f"{what}: {cause} (this is rank {self.rank}); the replay can no longer "
                       f"communicate{errors.ABORT_HINT}")
        deadline.mark_pending(self.comm, self.broken)
        raise errors.CollectiveTimeoutError(self.broken)

    def interrupted(self, what: str, e: BaseException) -> None:
        """A wait of collective ``what`` was left by ``e`` (a KeyboardInterrupt, a signal handler's exception):
        mark the communicator broken, as a timeout does, so that later calls raise at once and ``close`` is
        local instead of waiting out the deadline. Local, O(1)."""
        self.broken = (f"{what}: interrupted on rank {self.rank} by {type(e).__name__} before every rank of "
                       f"{self.size} arrived; the replay can no longer communicate{errors.ABORT_HINT}")
        deadline.mark_pending(self.comm, self.broken)

    def check_usable(self) -> None:
        """Raise if an earlier collective of this communicator failed. Local, O(1).

        Raises:
            CollectiveError: an earlier collective timed out.
        """
        if self.broken is not None:
            raise errors.CollectiveError(f"communicator unusable after an earlier failure: {self.broken}")

    # ---- collectives ------------------------------------------------------------------
    def allgather(self, values: np.ndarray, what: str) -> np.ndarray:
        """Every rank's ``values``, stacked. Collective: one Iallgather of ``values.nbytes`` per rank.

        Args:
            values: an array of the same shape and dtype on every rank.
            what: names the call in errors.
        Returns:
            ``[size, *values.shape]``, row r from rank r.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        values = np.ascontiguousarray(values)
        out = np.empty((self.size,) + values.shape, values.dtype)
        self.wait(self.comm.Iallgather(values, out), what)
        return out

    def allgatherv(self, values: np.ndarray, counts: np.ndarray, what: str) -> np.ndarray:
        """Concatenation of every rank's 1-D ``values``, in rank order. Collective: one Iallgatherv.

        Args:
            values: this rank's 1-D array (the same dtype on every rank).
            counts: ``counts[r]`` elements come from rank r (the same on every rank).
            what: names the call in errors.
        Returns:
            A new array of ``sum(counts)`` elements.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        values = np.ascontiguousarray(values)
        counts = np.asarray(counts, np.int64)
        out = np.empty(int(counts.sum()), values.dtype)
        dtype = mpi_type(values.dtype)
        self.wait(self.comm.Iallgatherv([values, dtype], [out, (counts, displacements(counts)), dtype]), what)
        return out

    def ialltoallv(self, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts,
                   send_displs=None, recv_displs=None):
        """Post a personalised exchange of 1-D arrays, not waited for. Collective: posted in the same order by all.

        Args:
            send: the 1-D array to send from (must outlive the request).
            send_counts: elements for each rank.
            recv: the 1-D array to receive into.
            recv_counts: elements from each rank.
            send_displs: where each rank's part starts in ``send`` (None: packed in rank order).
            recv_displs: where each rank's part goes in ``recv`` (None: packed in rank order).
        Returns: the MPI request; wait for it with :meth:`wait` or :meth:`wait_all`.
        """
        # lists: numpy's per-call overhead on a few counts cost more than the post (a sample posts several)
        sc, rc = np.asarray(send_counts, np.int64).tolist(), np.asarray(recv_counts, np.int64).tolist()
        sd = [0, *accumulate(sc[:-1])] if send_displs is None else np.asarray(send_displs, np.int64).tolist()
        rd = [0, *accumulate(rc[:-1])] if recv_displs is None else np.asarray(recv_displs, np.int64).tolist()
        return self.comm.Ialltoallv([send, (sc, sd), mpi_type(send.dtype)], [recv, (rc, rd), mpi_type(recv.dtype)])

    def alltoallv_bytes(self, send, send_counts, recv, recv_counts, what: str) -> None:
        """Personalised exchange of uint8 torch tensors, waited for. Collective: one Ialltoallv.

        CUDA tensors go to MPI as device buffers (needs a CUDA-aware MPI), CPU tensors as host memory.
        Args:
            send: the bytes to send, packed in rank order.
            send_counts: bytes for each rank.
            recv: the tensor to receive into, packed in rank order.
            recv_counts: bytes from each rank.
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        MPI = _mpi()
        sc = np.asarray(send_counts, np.int64)
        rc = np.asarray(recv_counts, np.int64)
        sd, rd = displacements(sc), displacements(rc)
        sb, rb = (t if t.is_cuda else t.numpy() for t in (send, recv))
        self.wait(self.comm.Ialltoallv([sb, (sc, sd), MPI.BYTE], [rb, (rc, rd), MPI.BYTE]), what)

    def alltoallv(self, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts, what: str,
                  send_displs=None, recv_displs=None) -> None:
        """Personalised exchange of 1-D arrays, waited for (see :meth:`ialltoallv`). Collective: one Ialltoallv.

        Args:
            send: the 1-D array to send from.
            send_counts: elements for each rank.
            recv: the 1-D array to receive into.
            recv_counts: elements from each rank.
            what: names the call in errors.
            send_displs: where each rank's part starts in ``send`` (None: packed in rank order).
            recv_displs: where each rank's part goes in ``recv`` (None: packed in rank order).
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        self.wait(self.ialltoallv(send, send_counts, recv, recv_counts, send_displs, recv_displs), what)

    def wait_all(self, requests: list, what: str) -> None:
        """Wait for several requests with one deadline (collective when they are).

        Args:
            requests: mpi4py requests (an empty list returns at once).
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        if len(requests) == 1:
            self.wait(requests[0], what)
        elif requests:
            self.wait(deadline.AllOf(_mpi(), requests), what)

    def alltoall(self, values: np.ndarray, what: str) -> np.ndarray:
        """Returns ``out[r]``: the int64 rank r sent to this rank. Collective: one Ialltoall of 8 bytes a pair.

        Args:
            values: ``values[r]`` goes to rank r (``size`` values).
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        values = np.ascontiguousarray(values, np.int64)
        out = np.empty(self.size, np.int64)
        self.wait(self.comm.Ialltoall(values, out), what)
        return out

    def gatherv(self, values: np.ndarray, root: int, what: str, out: np.ndarray | None = None,
                error: BaseException | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """Concatenation of every rank's 1-D ``values`` at ``root``.

        Collective: one allgather of ``(status, count)`` (16 bytes a rank, :meth:`agree`), one Igatherv. The
        counts are shared with every rank, so that a ``root`` that cannot receive (``error``: its buffer could
        not be allocated) makes every rank raise at once, in step, instead of the others waiting to send.

        Args:
            values: this rank's 1-D array (the same dtype on every rank).
            root: the rank that receives.
            what: names the call in errors.
            out: at ``root``, a 1-D array of ``values``' dtype and at least the total length to receive into
                (None: a new one).
            error: at ``root``, the exception that stops it receiving (ignored elsewhere).
        Returns:
            ``(values of all ranks, counts)`` at ``root`` (a view of ``out`` when given); ``(None, counts)``
            elsewhere.
        Raises:
            the class of ``root``'s ``error`` (as :meth:`agree`), on every rank; MemoryError: ``root`` cannot
            allocate the total (on every rank too); CollectiveTimeoutError: a rank did not arrive in time.
        """
        values = np.ascontiguousarray(values)
        counts = self.agree(error if self.rank == root else None, what, [len(values)])[:, 0].astype(np.int64)
        dtype = mpi_type(values.dtype)
        if self.rank == root:
            total = int(counts.sum())
            if out is None or len(out) < total:
                out = np.empty(total, values.dtype)
            out = out[:total]
            self.wait(self.comm.Igatherv([values, dtype], [out, (counts, displacements(counts)), dtype], root), what)
            return out, counts
        self.wait(self.comm.Igatherv([values, dtype], None, root), what)
        return None, counts

    def scatterv(self, chunks: list[np.ndarray] | None, dtype, root: int, what: str,
                 error: BaseException | None = None) -> np.ndarray:
        """Rank r receives ``chunks[r]`` from ``root``. Collective: one Iscatter of counts, one Iscatterv.

        When ``root`` could not make the chunks it passes its ``error`` instead: the same two messages then
        carry the error's class and text (:data:`MESSAGE_BYTES` a rank), and every rank raises it, so the
        others do not wait out the deadline and the ranks stay in step (the communicator stays usable).

        Args:
            chunks: at ``root``, one 1-D array per rank (ignored elsewhere, and at ``root`` with an ``error``).
            dtype: the element type (the same on every rank).
            root: the rank that sends.
            what: names the call in errors.
            error: at ``root``, the exception that stopped it making ``chunks`` (ignored elsewhere).
        Returns:
            This rank's chunk, a new 1-D array of ``dtype``.
        Raises:
            the class of ``root``'s ``error`` (as :meth:`agree`: ``"<what>: rank <root>: <message>"``), on
            every rank; CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        dtype = np.dtype(dtype)
        failed = self.rank == root and error is not None
        if failed:  # a negative count: -1 - the error's class code, then the message in place of the chunk
            counts = np.full(self.size, -1 - error_code(error), np.int64)
        elif self.rank == root:
            counts = np.array([len(c) for c in chunks], np.int64)
        else:
            counts = np.zeros(self.size, np.int64)
        mine = np.empty(1, np.int64)
        self.wait(self.comm.Iscatter(counts, mine, root), what)
        code = -1 - int(mine[0])
        words = MESSAGE_BYTES // 8
        out = np.empty(words if code >= 0 else int(mine[0]), np.int64 if code >= 0 else dtype)
        mt = mpi_type(out.dtype)
        if self.rank == root:
            if failed:
                send = np.tile(message_bytes(error).view(np.int64), self.size)
                counts = np.full(self.size, words, np.int64)
            else:
                send = np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros(0, dtype)
            self.wait(self.comm.Iscatterv([send, (counts, displacements(counts)), mt], [out, mt], root), what)
        else:
            self.wait(self.comm.Iscatterv(None, [out, mt], root), what)
        if code >= 0:
            raise _ERROR_CODES[code](f"{what}: rank {root}: {message_text(out)}") from error
        return out

    def barrier(self, what: str) -> None:
        """Wait until every rank has called ``barrier``. Collective: one Ibarrier, with the deadline.

        Args:
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        self.wait(self.comm.Ibarrier(), what)

    def bcast(self, values: np.ndarray, root: int, what: str) -> np.ndarray:
        """Returns ``root``'s ``values`` on every rank, as a new array. Collective: one Ibcast of ``values.nbytes``.

        Args:
            values: an array of the same shape and dtype on every rank (its content matters at ``root`` only).
            root: the rank that sends.
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        out = np.array(values, copy=True, order="C")
        self.wait(self.comm.Ibcast(out, root), what)
        return out

    def allgather_bytes(self, data: bytes, width: int, what: str) -> list[bytes]:
        """Every rank's ``data``, in rank order. Collective: one Iallgather of ``width`` bytes per rank.

        Args:
            data: at most ``width`` bytes (trailing zero bytes are not kept).
            width: the same on every rank.
            what: names the call in errors.
        Returns:
            One bytes object per rank.
        Raises:
            ValueError: ``data`` is longer than ``width`` (raised before the collective, on this rank only).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        if len(data) > width:
            raise ValueError(f"{what}: {len(data)} bytes do not fit in {width}")
        buf = np.zeros(width, np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        return [bytes(row).rstrip(b"\0") for row in self.allgather(buf, what)]

    def agree_signature(self, signature: str | Mapping[str, Any], what: str, hint: str = "") -> None:
        """Check that every rank passed the same ``signature``; the error says which field differs, and how.

        Collective: one Iallgather of a 32-byte digest per field; when one differs, one more allgather
        (at most :data:`FIELD_TEXT` bytes per differing field and rank) brings rank 0's and the first
        differing rank's values into the message.

        Args:
            signature: the fields to agree on, by name (``{"rate_limiter": limiter, ...}``; each compared
                as its ``str``, e.g. a repr), or one string (one field, ``"arguments"``). The names must
                be the same on every rank (the caller's code fixes them).
            what: names the call in errors.
            hint: appended to the error message.
        Raises:
            ValueError: on every rank, naming the lowest rank whose fields differ from rank 0's, each
                differing field, and its value on both ranks, e.g. ``"rate_limiter differs: rank 0
                SampleToInsertRatio(...), rank 1 None"``.
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        fields = {"arguments": signature} if isinstance(signature, str) else dict(signature) or {"arguments": ""}
        names = list(fields)
        texts = [v if isinstance(v, str) else str(v) for v in fields.values()]
        digests = b"".join(hashlib.sha256(f"{n}={t}".encode("utf-8", "replace")).digest() for n, t in zip(names, texts))
        table = self.allgather(np.frombuffer(digests, np.uint8), what).reshape(self.size, len(names), 32)
        differ = (table != table[0]).any(axis=2)  # [rank, field]
        ranks = np.flatnonzero(differ.any(axis=1))
        if not len(ranks):
            return
        r = int(ranks[0])
        which = np.flatnonzero(differ[r]).tolist()  # the same on every rank
        mine = b"\x1f".join(_clip(texts[i]) for i in which) if self.rank in (0, r) else b""
        got = self.allgather_bytes(mine, (FIELD_TEXT + 1) * len(which), what)
        values = [got[0].split(b"\x1f"), got[r].split(b"\x1f")]
        parts = []
        for k, i in enumerate(which):
            a, b = (v[k].decode("utf-8", "replace") if k < len(v) else "?" for v in values)
            parts.append(f"{names[i]} differs: rank 0 {a}, rank {r} {b}")
        raise ValueError(f"{what}: rank {r} was constructed with other arguments than rank 0: " + "; ".join(parts)
                         + (f" ({hint})" if hint else ""))

    def split_node(self, what: str) -> "MpiComm":
        """The ranks of this node (``MPI_COMM_TYPE_SHARED``, ordered by rank) as a new MpiComm.

        Collective: an Ibarrier with the deadline, then ``Split_type`` (it blocks, so the barrier goes first).
        Args:
            what: names the call in errors.
        Returns:
            A new MpiComm with the same deadline; free it with :meth:`free`.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        self.barrier(what)
        node = self.comm.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank)
        return MpiComm(node, self.timeout)

    def dup(self, what: str) -> "MpiComm":
        """Collective (one ``Idup``, with the deadline): a duplicate, whose collectives are never matched with
        this one's; the caller frees it. Args: what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        new, req = self.comm.Idup()
        self.wait(req, what)
        return MpiComm(new, self.timeout)

    def free(self) -> None:
        """Free the wrapped communicator (for communicators this layer created). Local; idempotent."""
        deadline.forget(self.comm)
        try:
            self.comm.Free()
        except Exception:
            pass

    # ---- error agreement --------------------------------------------------------------
    def agree(self, error: BaseException | None, what: str, values=None) -> np.ndarray:
        """Raise the same exception on every rank if any rank passes one; else share ``values``.

        The exception has the class of the lowest failing rank's error and the message ``"<what>: rank R:
        <message>"``. Collective: one allgather of ``8 (1 + len(values))`` bytes a rank (+1 KiB on failure).
        Args:
            error: this rank's exception, or None.
            what: names the call in errors.
            values: numbers to share when nobody failed (the same count on every rank; None: none).
        Returns:
            float64 ``[size, len(values)]``, row r from rank r.
        Raises:
            ValueError, TypeError, KeyError, a GearError or Exception: the class of the lowest failing rank's error.
            CollectiveError, CollectiveTimeoutError: an earlier collective failed; a rank did not arrive in time.
        """
        self.check_usable()
        values = () if values is None else values
        head = np.empty(1 + len(values), np.float64)
        head[0] = -1.0 if error is None else float(error_code(error))
        head[1:] = values
        table = self.allgather(head, what)
        if max(table[:, 0].tolist()) < 0:  # nobody failed (a few statuses: cheaper in Python than numpy)
            return table[:, 1:]
        self.raise_agreed(error, what, table[:, 0])

    def raise_agreed(self, error: BaseException | None, what: str, statuses) -> None:
        """Raise the lowest failing rank's error on every rank, once every rank knows that some rank failed.

        Collective: one allgather of 1 KiB a rank (the messages).
        Args:
            error: this rank's exception, or None.
            what: names the call in errors.
            statuses: every rank's status, agreed (``-1``: no error; else the error's class code).
        Raises:
            the lowest failing rank's error class, ``"<what>: rank R: <message>"`` (see :meth:`agree`);
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        statuses = np.asarray(statuses).astype(np.int64)
        messages = self.allgather(message_bytes(error), what)
        first = int(np.flatnonzero(statuses >= 0)[0])
        cls = _ERROR_CODES[int(statuses[first])]
        raise cls(f"{what}: rank {first}: {message_text(messages[first])}") from (error if error is not None else None)

    def agreed(self, build: Callable[[], Any], what: str, undo: Callable[[Any], None] | None = None) -> Any:
        """``build()`` on every rank, its failure agreed: one rank's error raises on all (Raises: as :meth:`agree`).
        Args: build: makes something (a shard); what: names the call; undo: releases what ``build`` made where
        it worked, when another rank failed. Returns: what ``build`` returned. Collective: one :meth:`agree`."""
        try:
            made, err = build(), None
        except Exception as e:
            made, err = None, e
        try:
            self.agree(err, what)
        except BaseException:
            if made is not None and undo is not None:
                undo(made)
            raise
        return made

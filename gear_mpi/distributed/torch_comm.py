"""TorchComm: window exchange over torch.distributed (NCCL for device buffers, gloo on CPU).

The replay's control messages (headers, counts, 48-byte choices) stay on MPI;
the bulk bytes of windows owned on other nodes travel here, between device
buffers, with ``all_to_all_single``. The process group is either passed in (a
training job's existing group) or bootstrapped from the MPI communicator: rank
0 picks a free TCP port on its host name and broadcasts ``host:port`` over MPI,
then every rank joins a new group of its own (``init_process_group`` when
torch.distributed is not initialised yet, else ``new_group`` over the same ranks).

Each call posts ``async_op=True`` and polls ``is_completed()`` until done or
``timeout`` seconds pass (then CollectiveTimeoutError, and the object is broken).
"""
from __future__ import annotations

import datetime
import os
import socket

import numpy as np
import torch
import torch.distributed as dist

from . import deadline
from .comm import DEFAULT_TIMEOUT, MpiComm, check_timeout
from ..errors import ABORT_HINT, CollectiveError, CollectiveTimeoutError

ADDRESS_BYTES = 256  # rank 0's "host:port", broadcast over MPI


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _bootstrap(mpi: MpiComm, backend: str, timeout: float, host: str | None):
    """Join the ranks of ``mpi`` in a torch.distributed group; returns ``(group, created)``.

    ``created`` is True when this call initialised torch.distributed (the group is then WORLD and
    its creator destroys it). Rank 0 broadcasts its host name and ``address:port``; a rank on the
    same host as rank 0 connects to 127.0.0.1 (the store listens on every interface), others to
    the address (``host``, else ``$GEAR_MPI_TORCH_HOST``, else rank 0's host name).
    """
    buf = np.zeros(ADDRESS_BYTES, np.uint8)
    if mpi.rank == 0:
        address = host or os.environ.get("GEAR_MPI_TORCH_HOST") or socket.gethostname()
        text = f"{socket.gethostname()} {address}:{_free_port()}".encode()
        if len(text) > ADDRESS_BYTES:  # said in the broadcast (a host name starts with no "!"): every rank raises it
            text = (f"!torch.distributed bootstrap: rank 0's address ({len(address)} characters: "
                    f"{address[:40]!r}...) is too long: {len(text)} > {ADDRESS_BYTES} bytes with its host name and "
                    f"port").encode()[:ADDRESS_BYTES]
        buf[:len(text)] = np.frombuffer(text, np.uint8)
    text = bytes(mpi.bcast(buf, 0, "torch.distributed bootstrap (address)")).rstrip(b"\0").decode("utf-8", "replace")
    if text.startswith("!"):
        raise ValueError(text[1:])
    root_host, endpoint = text.split(" ", 1)
    address, port = endpoint.rsplit(":", 1)
    if host is None and not os.environ.get("GEAR_MPI_TORCH_HOST") and socket.gethostname() == root_host:
        address = "127.0.0.1"
    td = datetime.timedelta(seconds=max(timeout, 1.0))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=mpi.rank,
                                world_size=mpi.size, timeout=td)
        return dist.group.WORLD, True
    if dist.get_world_size() != mpi.size:
        raise ValueError("torch.distributed is already initialised over other ranks: pass process_group=")
    return dist.new_group(backend=backend, timeout=td), False


def init_process_group(comm, backend: str = "gloo", timeout: float = 60.0, host: str | None = None):
    """Start torch.distributed over the ranks of an MPI communicator, with no launcher variables.

    For DDP (or any torch collective) beside the replay in an ``mpiexec``/``srun`` job: rank 0
    picks a free TCP port, its address travels over MPI, and every rank joins. If torch.distributed
    is already initialised over the same number of ranks, a new group over them is made instead.

    Collective over ``comm``. Cost: one allgather of 8 bytes a rank (the arguments' checks, agreed), one
    256-byte MPI broadcast, torch's TCP rendezvous (one connection per rank to rank 0), one MPI barrier.

    Args:
        comm: an mpi4py communicator or :class:`~gear_mpi.distributed.comm.MpiComm` (its rank order is kept).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout: seconds every rank may wait for the others (broadcast, rendezvous, barrier).
        host: the address other hosts reach rank 0 at (default ``$GEAR_MPI_TORCH_HOST`` or rank 0's
            host name); ranks on rank 0's host connect through 127.0.0.1.

    Returns:
        The process group: ``torch.distributed.group.WORLD`` when this call initialised
        torch.distributed (pass nothing as ``group=`` then), else the new group.

    Raises:
        ValueError: on every rank: a bad backend, a ``timeout`` that is not a positive number, an address of
            rank 0 too long to send, or torch.distributed already initialised over another rank count.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    """
    err = None
    try:
        check_timeout(timeout)
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    except ValueError as e:  # agreed below, so that every rank raises it
        err = e
    mpi = comm if isinstance(comm, MpiComm) else MpiComm(comm, DEFAULT_TIMEOUT if err is not None else timeout)
    mpi.agree(err, "init_torch_process_group")
    group, _ = _bootstrap(mpi, backend, float(timeout), host)
    mpi.barrier("torch.distributed bootstrap")
    return group


class TorchComm:
    """Personalised exchanges of tensors over a torch.distributed process group.

    ``backend``: ``"nccl"`` (CUDA tensors) or ``"gloo"`` (CPU tensors).
    Cost of :meth:`alltoallv`: one ``all_to_all_single`` of the bytes sent.
    """

    def __init__(self, mpi_comm, backend: str = "nccl", timeout: float = 60.0, process_group=None,
                 host: str | None = None):
        """Args:
            mpi_comm: an :class:`~gear_mpi.distributed.comm.MpiComm` or an mpi4py communicator over the same ranks.
            backend: ``"nccl"`` or ``"gloo"``.
            timeout: seconds every collective (the bootstrap included) may wait for a rank.
            process_group: an existing torch.distributed group over the same ranks (no bootstrap).
            host: the address rank 0 listens on (default ``$GEAR_MPI_TORCH_HOST`` or its host name).

        Collective. Raises:
            ValueError: a bad backend, or a group over other ranks.
            CollectiveTimeoutError: a rank did not arrive at the bootstrap within ``timeout``.
        """
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        mpi = mpi_comm if isinstance(mpi_comm, MpiComm) else MpiComm(mpi_comm, timeout)
        self.backend = backend
        self.timeout = float(timeout)
        self.rank = mpi.rank
        self.size = mpi.size
        self.broken: str | None = None
        self.owns_group = False
        if process_group is not None:
            self.group = process_group
            if dist.get_world_size(process_group) != self.size:
                raise ValueError(f"process_group has {dist.get_world_size(process_group)} ranks, "
                                 f"the MPI communicator {self.size}")
            return
        self.group, self.owns_group = _bootstrap(mpi, backend, self.timeout, host)
        mpi.barrier("TorchComm (construction)")

    def _wait(self, work, what: str) -> None:
        if not deadline.poll(work.is_completed, self.timeout):
            self.broken = (f"{what}: not every rank of {self.size} arrived within timeout={self.timeout:g} s"
                           f"{ABORT_HINT}")
            raise CollectiveTimeoutError(self.broken)
        work.wait()

    def alltoallv(self, send: torch.Tensor, send_counts, recv: torch.Tensor, recv_counts, what: str) -> None:
        """Personalised exchange of 1-D tensors. Collective: one ``all_to_all_single`` of the bytes sent.

        Args:
            send: the elements to send, rank r's ``send_counts[r]`` after those of lower ranks.
            send_counts: elements for each rank.
            recv: filled with ``recv_counts[s]`` elements from each rank s, in rank order.
            recv_counts: elements from each rank.
            what: names the call in errors.
        Raises:
            CollectiveError: an earlier call timed out (this object is broken).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        """
        if self.broken is not None:
            raise CollectiveError(f"torch communicator unusable after an earlier failure: {self.broken}")
        work = dist.all_to_all_single(recv, send, output_split_sizes=[int(c) for c in recv_counts],
                                      input_split_sizes=[int(c) for c in send_counts], group=self.group,
                                      async_op=True)
        self._wait(work, what)

    def close(self) -> None:
        """Destroy the process group this object created, if any (collective over its ranks). Idempotent."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

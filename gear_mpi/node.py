"""The node: the ranks that share this rank's memory, their mapped shard columns, and the node fence.

A requester copies windows owned by ranks on its own node straight out of their
shared memory (POSIX segments of ``memory="shm"`` shards, or the files of
``memory="file"`` shards, mapped at construction); windows owned by any other
rank travel through the window transport (so do a node peer's windows when its
arena is private or copy-on-write: ``memory="private"``, ``Replay.load(mmap=True)``). :class:`NodeView` holds what that needs: which owners this rank reads
directly (``direct``), the address of every directly readable column ring (for
the gather kernel), the same memory mapped into the GPU (``device="cuda"``).

The node fence keeps an owner from overwriting a window a node peer still reads:
after a sample each rank publishes, in its own segment's header, that it has
finished reading its peers' windows of that sample; an owner about to write its
shard waits (:meth:`NodeView.settle`) until every node peer that reads it
directly has published the last sample. No message is sent: when another
collective has been passed since, the wait is free.
"""
from __future__ import annotations

import os

import numpy as np

from . import deadline
from .comm import MpiComm
from .errors import CollectiveTimeoutError
from .kernels import hints
from .memory import SHARED_KINDS, reads_done_counter
from .shard import Shard
from .windows import attach_columns, column_addresses

NAME_BYTES = 4096  # room for a shared-memory segment's name or an arena file's path in the construction allgather


class NodeView:
    """This rank's view of its node (see the module docstring). Build it with :meth:`join`,
    then :meth:`attach` once this rank's shard exists.

    Args:
        comm: the replay's communicator.
        node_comm: the communicator of this node's ranks (this object frees it in :meth:`close`).
        ranks: the node's ranks, as ranks of ``comm``, in node-rank order.
    Attributes (after :meth:`attach`; arrays indexed by rank of the whole communicator):
        direct: bool, whether this rank copies owner o's windows from memory (always itself;
            its node peers unless ``force_alltoallv``). Symmetric on a node.
        any_remote: whether any rank of the communicator reads some owner through the transport.
        column_addrs: ``[ranks, columns]`` int64, the address of each directly readable column ring.
        peer_direct, remote: int64 0/1, owners read directly other than this rank / read through
            the transport (for the window counters).
        device_views: owner -> column -> the owner's columns mapped into the GPU (device replays).
    """

    def __init__(self, comm: MpiComm, node_comm: MpiComm, ranks: list[int]):
        self.comm = comm
        self.node_comm = node_comm
        self.ranks = ranks
        self.epoch = 0    # samples this rank has entered (the same count on every rank: sample is collective)
        self.settled = 0  # the last sample whose node-peer reads are known to be over
        self.closing = comm  # join() replaces it by a duplicate of comm, for the replay's closing barrier
        self.node_peers = False
        self._arenas: dict = {}
        self.peer_views: dict[int, dict[str, np.ndarray]] = {}
        self.device_views: dict[int, dict] = {}
        self._mapped: list = []

    @classmethod
    def join(cls, comm: MpiComm, what: str = "Replay construction") -> "NodeView":
        """Collective: split ``comm`` by node and learn the node's ranks (an Ibarrier, ``Split_type``
        and one allgather of 8 bytes per node rank, each with the deadline), and duplicate ``comm`` for
        the closing barrier (one ``Idup``): a rank's close must never be matched with a collective its
        peers still run (a sample of ranks that went on after this one stopped), which Open MPI would
        do, handing them this rank's barrier as their data.

        Args:
            comm: the replay's communicator.
            what: names the call in errors.
        Returns:
            A new NodeView (not yet attached).
        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline.
        """
        node_comm = comm.split_node(f"{what} (node split)")
        try:
            ranks = node_comm.allgather(np.array([comm.rank], np.int64), f"{what} (node ranks)")[:, 0]
            closing = comm.dup(f"{what} (close communicator)")
        except BaseException:
            node_comm.free()
            raise
        view = cls(comm, node_comm, [int(r) for r in ranks])
        view.closing = closing
        return view

    @property
    def size(self) -> int:
        """Ranks on this node. O(1)."""
        return len(self.ranks)

    @property
    def local_rank(self) -> int:
        """This rank's rank within its node. O(1)."""
        return self.node_comm.rank

    def attach(self, shard: Shard, memory: str, force_alltoallv: bool, device=None,
               what: str = "Replay construction") -> None:
        """Collective: map the node peers' columns (``memory`` ``"shm"`` or ``"file"``), decide which owners
        are read directly, and (``device``, a DeviceContext) map the node's arenas into the GPU.

        Cost: one allgather of 4 KiB per node rank, a node barrier, one allgather of 8 bytes
        per rank, one mmap per node peer; each with the deadline.
        Args:
            shard: this rank's shard.
            memory: the replay's memory kind (``"shm"``, ``"file"``: map the node peers' columns).
            force_alltoallv: read node peers' windows through the transport, not from their memory.
            device: the replay's ``DeviceContext`` (None: no GPU mapping).
            what: names the call in errors.
        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline.
            FileNotFoundError, ValueError: a node peer's segment is gone, or not of this spec and capacity;
                a file-backed arena the GPU cannot register (see :mod:`gear_mpi.file_memory`).
        """
        rank, size, spec, cap = self.comm.rank, self.comm.size, shard.spec, shard.capacity_steps
        self._arenas = {rank: shard.store.arena}
        self.peer_views = {rank: shard.store.byte_views()}
        name = (shard.shm_name or "").encode()  # a file's path fits: PATH_MAX is 4096 with its NUL
        names = self.node_comm.allgather_bytes(name, NAME_BYTES, f"{what} (shared-memory names)")
        if memory in SHARED_KINDS:
            for peer, peer_name in zip(self.ranks, names):
                if peer != rank and peer_name:
                    self._arenas[peer], self.peer_views[peer] = attach_columns(peer_name.decode(), spec, cap)
            self.node_comm.barrier(f"{what} (shared memory mapped)")  # every peer has mapped the segments:
            shard.store.arena.unlink()  # drop their names, so that no crash can leave them behind in /dev/shm
        self.direct = np.array([r in self.peer_views and (r == rank or not force_alltoallv) for r in range(size)])
        anyone = self.comm.allgather(np.array([not bool(self.direct.all())], np.int64), f"{what} (transport)")
        self.any_remote = bool(anyone.any())
        # the node fence's counters: this rank's own (peers read it) and every peer's that reads this rank
        self._reads_done = reads_done_counter(shard.store.arena.buffer)
        self._peer_done = [reads_done_counter(self._arenas[r].buffer) for r in range(size)
                           if r != rank and self.direct[r]]
        self.column_addrs = np.zeros((size, len(spec.columns)), np.int64)
        for r, views in self.peer_views.items():
            if self.direct[r]:
                self.column_addrs[r] = column_addresses(views, spec, cap)
        self.peer_direct = (self.direct & (np.arange(size) != rank)).astype(np.int64)
        self.remote = (~self.direct).astype(np.int64)
        self.node_peers = bool(self.peer_direct.any())
        if device is not None:
            # page-lock the node's arenas and map them into this GPU's address space (zero copy)
            from .pinned import map_byte_views
            for r, arena in self._arenas.items():
                try:
                    mapped, views = map_byte_views(arena.buffer, self.peer_views[r])
                except Exception as e:
                    if arena.kind not in ("file", "mapped"):
                        raise
                    raise ValueError(f"device replays page-lock the arena, and the GPU could not register "
                                     f"rank {r}'s file-backed one ({type(e).__name__}: {e}); use memory='shm' "
                                     f"or 'private' with device='cuda'") from e
                self._mapped.append(mapped)
                self.device_views[r] = views

    def share_cores(self) -> None:
        """Give this rank's numba kernels its share of the node's cores (unless NUMBA_NUM_THREADS is
        set): ranks that each start as many threads as the node has cores oversubscribe it. Local, O(1)."""
        if "NUMBA_NUM_THREADS" in os.environ:
            return
        import numba
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, cores // max(1, self.size))))

    # ---- the node fence -----------------------------------------------------------------
    def begin_sample(self) -> None:
        """Every rank has entered a new sample, so every node peer is done reading the last one's windows.

        Local, O(1): no message (the sample's first collective is the proof).
        """
        self.epoch += 1
        self.settled = self.epoch - 1

    def publish(self) -> None:
        """This rank's reads of its node peers' memory for the current sample are over.

        Local, O(1): a fence and one store into this rank's own segment header (when it has node peers).
        """
        if self.node_peers:
            hints.publish(self._reads_done, self.epoch)

    def settle(self) -> None:
        """Before this rank writes its shard again, wait until every node peer has finished reading
        its windows of the last sample. Free when a collective has been passed since; otherwise a
        poll of a few shared counters (gear_mpi.deadline.poll), with the communicator's deadline.

        Raises:
            CollectiveTimeoutError: a node peer did not publish within the deadline.
        """
        if not self.node_peers or self.settled == self.epoch:
            return
        epoch = self.epoch
        timeout = self.comm.timeout
        if not deadline.poll(lambda: all(int(d[0]) >= epoch for d in self._peer_done), timeout):
            raise CollectiveTimeoutError(f"node fence: a node peer did not finish reading this rank's windows "
                                         f"of sample {epoch} within timeout={timeout:g} s")
        hints.fence()  # no write of ours before the peers' reads that the counters vouch for
        self.settled = epoch

    def closing_barrier(self) -> None:
        """Collective: the replay's closing barrier, on the closing communicator (one Ibarrier, with the deadline).

        Raises:
            CollectiveTimeoutError: a rank did not arrive within the deadline; the replay's communicator is then
                marked unusable too (its ranks are out of step), as when the barrier ran on it.
        """
        try:
            self.closing.barrier("close")
        except CollectiveTimeoutError:
            self.comm.broken = self.closing.broken
            deadline.mark_pending(self.comm.comm, self.closing.broken)
            raise

    def close(self) -> None:
        """Unmap the GPU mappings and the node peers' columns, free the node and closing communicators (local).
        Idempotent; this rank's own arena is its shard's to close."""
        for mapped in self._mapped:  # unregister the pinned mappings before unmapping the arenas
            mapped.close()
        self._mapped, self.device_views = [], {}
        self.peer_views = {}
        rank = self.comm.rank
        for r, arena in self._arenas.items():
            if r != rank:
                arena.close()
        self._arenas = {}
        self.node_comm.free()
        if self.closing is not self.comm:
            self.closing.free()
            self.closing = self.comm

"""The node: the ranks that share this rank's memory, their mapped shard columns, and the node fence.

A requester copies windows owned by ranks on its own node straight out of their
shared memory (POSIX segments of ``memory="shm"`` shards, or the files of
``memory="file"`` shards, mapped at construction; under ``"shm"`` a compressed column's
chunks and chunk table too, decoded by the requester: :mod:`gear_mpi.storage.shared_chunks`;
under ``"file"`` compressed columns travel by MPI); windows owned by any other
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

import ctypes
import os
import platform
import time

import numpy as np

from . import deadline
from .. import errors
from .comm import MpiComm
from ..errors import CollectiveTimeoutError
from ..kernels import board as board_kernels
from ..kernels import hints
from ..storage.arenas import SHARED_KINDS, SharedArena, reads_done_counter
from ..shard import Shard
from ..storage.columns import attach_columns, column_addresses
from ..storage.shared_chunks import PeerChunks, unlink_rings

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
        self.board: NodeBoard | None = None
        self._arenas: dict = {}
        self.peer_views: dict[int, dict[str, np.ndarray]] = {}
        #: node peer -> its compressed columns read in place (``memory="shm"``; storage.shared_chunks)
        self.peer_chunks: dict[int, PeerChunks] = {}
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
                a file-backed arena the GPU cannot register (see :mod:`gear_mpi.storage.file_arenas`).
        """
        rank, size, spec, cap = self.comm.rank, self.comm.size, shard.spec, shard.capacity_steps
        self._arenas = {rank: shard.store.arena}
        self.peer_views = {rank: shard.store.byte_views()}
        name = (shard.shm_name or "").encode()  # a file's path fits: PATH_MAX is 4096 with its NUL
        names = self.node_comm.allgather_bytes(name, NAME_BYTES, f"{what} (shared-memory names)")
        # compressed columns: under "shm" node peers read the chunks in place (storage.shared_chunks); elsewhere
        # (memory="file": the chunk logs are the owner's alone) their windows come through MPI
        chunks_shared = memory == "shm" and bool(spec.compressed) and not force_alltoallv
        if memory in SHARED_KINDS:
            for peer, peer_name in zip(self.ranks, names):
                if peer != rank and peer_name:
                    self._arenas[peer], self.peer_views[peer] = attach_columns(peer_name.decode(), spec, cap)
                    if chunks_shared:
                        self.peer_chunks[peer] = PeerChunks(spec, cap, peer_name.decode(), self.peer_views[peer],
                                                            peer)
            self.node_comm.barrier(f"{what} (shared memory mapped)")  # every peer has mapped the segments:
            shard.store.arena.unlink()  # drop their names, so that no crash can leave them behind in /dev/shm
            unlink_rings(shard.store.compressed)
        peers_direct = not force_alltoallv and (not spec.compressed or chunks_shared)
        self.direct = np.array([r in self.peer_views and (r == rank or peers_direct) for r in range(size)])
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
        if device is None and size > 1 and not self.any_remote:  # one node, every rank read directly
            self.board = NodeBoard(self.comm, self.node_comm, self.ranks, what)
        if device is not None:
            # page-lock the node's arenas and map them into this GPU's address space (zero copy)
            from ..storage.pinned import map_byte_views
            for r, arena in self._arenas.items():
                try:  # compressed columns have no ring in the arena: decoded on the host (WindowTransport)
                    mapped, views = map_byte_views(arena.buffer, {n: v for n, v in self.peer_views[r].items()
                                                                  if spec[n].compression is None})
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
        set, nor GEAR_MPI_THREADS / gear_mpi.set_threads chosen): ranks that each start as many threads as the
        node has cores oversubscribe it. Local, O(1)."""
        from .. import threads
        if "NUMBA_NUM_THREADS" in os.environ or threads.chosen() is not None:
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
        poll of a few shared counters (gear_mpi.distributed.deadline.poll), with the communicator's deadline.

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
        # the fence's counters view this rank's arena and the peers': dropped, so that the mappings (and a
        # memory="file" shard's disk space) go at close, not when this object is collected
        self._reads_done, self._peer_done = np.zeros(1, np.int64), []
        for chunks in self.peer_chunks.values():
            chunks.close()
        self.peer_chunks = {}
        if self.board is not None:
            self.board.close()
            self.board = None
        rank = self.comm.rank
        for r, arena in self._arenas.items():
            if r != rank:
                arena.close()
        self._arenas = {}
        self.node_comm.free()
        if self.closing is not self.comm:
            self.closing.free()
            self.closing = self.comm


# ---- the node board: every collective's head and a sample's choices through shared memory ---------------
# a rank's board (kernels.board's layout): head counter, choices counter, sleeping word, two head rows, then choices
_SLOT = board_kernels.SLOT  # bytes before the choices
CHOICE_CAPACITY = 8192  # choices an owner posts on its board per sample; more: that sample's choices travel by MPI


_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if os.name == "posix" else None
_LIBC = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex(word: np.ndarray, op: int, value: int, seconds: float = 0.0) -> None:
    """FUTEX_WAIT (sleep while ``word[0] == value``, at most ``seconds``) or FUTEX_WAKE (every sleeper)."""
    ts = ctypes.byref(_Timespec(int(seconds), int((seconds % 1.0) * 1e9))) if op == _FUTEX_WAIT else None
    _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(word.ctypes.data), ctypes.c_int(op),
                  ctypes.c_int(value), ts, None, ctypes.c_int(0))


def _reached(word: np.ndarray, target: int) -> bool:
    """Whether a 32-bit counter has reached ``target`` (modulo 2**32, so wrapping is harmless)."""
    return (int(word[0]) - target) & 0xFFFFFFFF < 0x80000000


def _warm_round_kernels() -> None:
    """Call each round kernel of :mod:`gear_mpi.kernels.board` once on a scratch one-rank board, with the argument
    types a board's rounds pass: compiled (or loaded from numba's cache) before the first round. Local."""
    k = board_kernels
    scratch = np.zeros(k.SLOT + 8 * k.CHOICE_WIDTH, np.uint8)
    bases = np.array([scratch.ctypes.data], np.int64)
    k.share_row(bases, 0, 1, np.zeros(2, np.float64))
    k.gather_rows(bases, 1, np.empty((1, 2), np.float64), 1, 0)
    k.publish_choices(bases, 0, 1)
    choices = np.zeros((1, k.CHOICE_WIDTH), np.int64)
    k.collect_choices(bases, 0, np.ones((1, 1), np.int64), 1, choices, choices.copy(), 1, 1, 0)
    pairs = np.zeros((1, 2), np.int64)
    k.post_pairs(bases, 0, 1, pairs, k.CHOICE_WIDTH)
    k.collect_pairs(bases, 0, np.ones((1, 1), np.int64), 1, pairs, k.CHOICE_WIDTH, 1, 0)


class NodeBoard:
    """Samples of a replay whose ranks all share one node, synchronised through shared memory, no MPI.

    Each rank owns a small shared segment (its *board*): a header counter and two header rows
    (alternating: a rank can be at most one round ahead of another), a choices counter, and room for
    :data:`CHOICE_CAPACITY` choices (48 bytes each) that the rank serves per sample. :meth:`share` /
    :meth:`gather` replace the allgather of every collective's head (a sample's header among them;
    :mod:`gear_mpi.distributed.calls`), :meth:`post` / :meth:`collect` the choices' alltoallv, :meth:`route_pairs`
    a routed update's: no MPI call. Each side of a round is one kernel call (:mod:`gear_mpi.kernels.board`, which
    also sets the layout), whose short poll (8-16 us; four reads where the node's ranks outnumber its cores:
    ``poll``) finds a peer in step with this rank; past it, a rank waiting for a peer polls the peer's counter,
    yielding its core between polls
    (``sched_yield``: on an oversubscribed node the core goes to a rank that works) for 20 ms
    (as :func:`gear_mpi.distributed.deadline.poll`), then sleeps on it (a futex the publisher wakes; where
    there is none, sleeps of up to 1 ms).
    Construction is collective over the node: one allgather of names, a barrier.

    Args:
        comm: the replay's communicator (every rank on this node); node_comm: the node's communicator.
        ranks: the node's ranks as ranks of ``comm``, in node-rank order; what: names the calls in errors.
    Raises:
        CollectiveTimeoutError: a rank did not arrive within the deadline.
        MemoryBudgetError: no room in /dev/shm for the board (about 400 KiB a rank).
    """

    def __init__(self, comm: MpiComm, node_comm: MpiComm, ranks: list[int], what: str):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.arena = SharedArena(_SLOT + CHOICE_CAPACITY * 48)
        self._arenas = {}
        try:
            names = node_comm.allgather_bytes(self.arena.name.encode(), NAME_BYTES, f"{what} (node board names)")
            for r, name in zip(ranks, names):
                self._arenas[r] = self.arena if r == self.rank else SharedArena.attach(name.decode())
            node_comm.barrier(f"{what} (node board mapped)")
        except BaseException:
            self.close()
            raise
        self.arena.unlink()
        bufs = [self._arenas[r].buffer for r in range(self.size)]
        self._bases = np.array([b.ctypes.data for b in bufs], np.int64)  # for the round kernels (kernels.board)
        k = board_kernels
        self.head_count = [b[k.HEAD_COUNT:k.HEAD_COUNT + 4].view(np.uint32) for b in bufs]
        self.choice_count = [b[k.CHOICE_COUNT:k.CHOICE_COUNT + 4].view(np.uint32) for b in bufs]
        self.pair_count = [b[k.PAIR_COUNT:k.PAIR_COUNT + 4].view(np.uint32) for b in bufs]
        self.sleeping = [b[k.SLEEPING:k.SLEEPING + 4].view(np.uint32) for b in bufs]  # 1 + the rank it sleeps on
        self.choices = [b[_SLOT:].view(np.int64).reshape(CHOICE_CAPACITY, k.CHOICE_WIDTH) for b in bufs]
        self.rounds = 0  # rows shared (the same on every rank)
        self.pair_rounds = 0  # routed updates through the boards (the same on every rank)
        # the round kernels' poll of a peer (spins, cycles): short where the node's ranks outnumber its cores (a
        # rank spinning there holds the core the peer it waits for needs: 4 ranks on 2 cores, centralized hopper
        # 1.10-1.20 -> 1.19-1.27 ms a call with the full poll); the Python wait that follows yields the core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.poll = ((board_kernels.POLL_SPINS, board_kernels.POLL_CYCLES) if self.size <= cores
                     else (board_kernels.POLL_SPINS_SHARED, board_kernels.POLL_CYCLES_SHARED))
        # seconds of polling (yielding the core) before sleeping on a futex; a futex from the start, or
        # after 50 us, measured slower on W1 with 4 ranks on 2 cores (1.53 / 1.22 against 1.12 ms a call)
        self.spin = 0.02
        hints.publish(self.head_count[self.rank], 0)  # compile (cache) the ordered store now
        _warm_round_kernels()  # and the round kernels: no rank compiles inside a round while the others wait

    def share(self, row) -> int:
        """Write this rank's row of the next round and publish it (local, O(len(row))): the first half of an
        allgather over the board, which :meth:`gather` completes. Every rank shares a row per round, in the
        same order as its other collectives (:class:`~gear_mpi.distributed.calls.ReplayCalls` heads).

        Args:
            row: up to ``16`` numbers (float64).
        Returns:
            The round's number, for :meth:`gather`.
        """
        n = self.begin_round()
        row = row if type(row) is np.ndarray and row.dtype == np.float64 else np.asarray(row, np.float64)
        if board_kernels.share_row(self._bases, self.rank, n, row):  # the row, then the counter, in one call
            self._wake(self.head_count)
        return n

    def begin_round(self) -> int:
        """The next head round's number, for a caller that shares its row with a kernel of its own
        (:mod:`gear_mpi.kernels.sample_rounds`, given :attr:`bases`; then :meth:`end_heads`). Local, O(1)."""
        self._check_open()
        self.rounds += 1
        return self.rounds

    @property
    def bases(self) -> np.ndarray:
        """Every rank's board address (int64, rank order), for the round kernels. Raises RuntimeError once closed."""
        self._check_open()
        return self._bases

    def gather(self, n: int, width: int, what: str) -> np.ndarray:
        """Every rank's row of round ``n`` (:meth:`share`), once each has published it (local waits, with the
        deadline; no MPI call).

        Args:
            n: the round; width: numbers a row holds; what: names the call in errors.
        Returns:
            float64 ``[ranks, width]``, row r from rank r.
        Raises:
            CollectiveTimeoutError: a rank did not share its row within the deadline (the replay is then unusable).
        """
        self._check_open()
        table = np.empty((self.size, width), np.float64)
        k = board_kernels
        if not k.gather_rows(self._bases, n, table, *self.poll):  # a short poll, then the rows
            self.end_heads(n, table, 0, what)
        return table

    def end_heads(self, n: int, table: np.ndarray, code: int, what: str) -> None:
        """Finish head round ``n`` after a kernel that shared this rank's row and polled for the others' (its
        ``code``: :data:`~gear_mpi.kernels.sample_rounds.WAKE`, :data:`~gear_mpi.kernels.sample_rounds.READ`):
        wake a sleeping peer, and unless the rows were read, wait for them (yielding, then sleeping, with the
        deadline) and read them into ``table``. Local.

        Raises:
            CollectiveTimeoutError: a rank did not share its row within the deadline.
        """
        if code & 1:
            self._wake(self.head_count)
        if not code & 2:
            self.wait(self.head_count, range(self.size), n, what)
            board_kernels.gather_rows(self._bases, n, table, 1, 0)

    def post(self, choices: np.ndarray, epoch: int) -> None:
        """Owner: publish this sample's served choices (in requester order) on this rank's board. Local.

        Args:
            choices: ``[n, 6]`` int64, ``n <= CHOICE_CAPACITY``; epoch: the sample's number (NodeView.epoch).
        """
        self.choices[self.rank][:len(choices)] = choices
        self.posted(epoch)

    def posted(self, epoch: int) -> None:
        """Owner: the choices written straight into this rank's board rows (``choices[rank]``, as :meth:`post`
        copies them) are sample ``epoch``'s: publish them. Local, O(1)."""
        self._check_open()
        if board_kernels.publish_choices(self._bases, self.rank, epoch):
            self._wake(self.choice_count)

    def collect(self, counts: np.ndarray, epoch: int, own: np.ndarray, got: np.ndarray, what: str) -> None:
        """Requester: this rank's choices of every owner, in owner order, into ``got``.

        Local waits on the owners' counters (with the deadline). Args: counts: ``[ranks, ranks]``, items
        owner o serves requester r at ``[r, o]``; epoch: as :meth:`post`; own: this rank's served choices;
        got: ``[sum(counts[rank]), 6]`` int64. Raises: CollectiveTimeoutError: an owner never posted.
        """
        self._check_open()
        k = board_kernels
        if not k.collect_choices(self._bases, self.rank, counts, epoch, own, got, CHOICE_CAPACITY,
                                 *self.poll):  # a short poll, then the rows
            self.end_choices(counts, epoch, own, got, 0, what)

    def end_choices(self, counts: np.ndarray, epoch: int, own: np.ndarray, got: np.ndarray, code: int,
                    what: str) -> None:
        """Finish sample ``epoch``'s choices after a kernel that published this rank's and polled for its owners'
        (its ``code``, as :meth:`end_heads`): wake a sleeping peer, and unless they were collected, wait for the
        owners (yielding, then sleeping, with the deadline) and collect them into ``got`` (as :meth:`collect`).
        Local.

        Raises:
            CollectiveTimeoutError: an owner never posted.
        """
        if code & 1:
            self._wake(self.choice_count)
        if not code & 2:
            mine = counts[self.rank]
            owners = [o for o in range(self.size) if mine[o] and o != self.rank]
            self.wait(self.choice_count, owners, epoch, what)
            board_kernels.collect_choices(self._bases, self.rank, counts, epoch, own, got, CHOICE_CAPACITY, 1, 0)

    #: int64 words of a board's choices, which a routed update's pairs use between two samples
    PAIR_WORDS = CHOICE_CAPACITY * board_kernels.CHOICE_WIDTH

    def route_pairs(self, pairs: np.ndarray, counts: np.ndarray, what: str) -> np.ndarray:
        """A routed update's keys and priorities to their owners through the boards (no MPI call): this rank's
        ``(key, priority bits)`` pairs, sorted by owner, posted on its board; every rank's for this one collected.
        Called by every rank, between the update's head and anything else (a board's choices are free then: each
        peer read the last sample's before it shared this head; they are read before the next head is shared).

        Args:
            pairs: int64 ``[k, 2]``, sorted by owner; at most ``PAIR_WORDS / 2`` on every rank (agreed).
            counts: int64 ``[ranks, ranks]``: pairs rank r has for owner o at ``[r, o]`` (every rank's, agreed).
            what: names the call in errors.
        Returns:
            int64 ``[sum(counts[:, rank]), 2]``: the pairs for this rank, in sender order.
        Raises:
            CollectiveTimeoutError: a sender never posted within the deadline.
        """
        self._check_open()
        self.pair_rounds += 1
        n, k = self.pair_rounds, board_kernels
        if k.post_pairs(self._bases, self.rank, n, pairs, self.PAIR_WORDS):
            self._wake(self.pair_count)
        got = np.empty((int(counts[:, self.rank].sum()), 2), np.int64)
        if not k.collect_pairs(self._bases, self.rank, counts, n, got, self.PAIR_WORDS, *self.poll):
            senders = [r for r in range(self.size) if counts[r, self.rank]]
            self.wait(self.pair_count, senders, n, what)  # yielding, then sleeping, with the deadline
            k.collect_pairs(self._bases, self.rank, counts, n, got, self.PAIR_WORDS, 1, 0)
        return got

    def _check_open(self) -> None:
        if self._bases is None:
            raise RuntimeError("node board: closed (its replay was closed)")

    def _wake(self, counters: list) -> None:
        """Wake the node peers sleeping on this rank's counter in ``counters`` (the round kernels saw one's
        sleeping word name this rank after publishing it; a futex wake, where there are futexes)."""
        if _LIBC is not None:
            _futex(counters[self.rank], _FUTEX_WAKE, 0x7FFFFFFF)

    def wait(self, counters: list, ranks, target: int, what: str) -> None:
        """Wait until ``counters[r]`` reached ``target`` for every ``r`` in ``ranks`` (local, with the deadline).

        Polls, yielding the core between polls, for ``spin`` seconds, then sleeps on the counter (a futex)
        with this rank's ``sleeping`` word set, so that the publisher wakes it.
        Raises:
            CollectiveTimeoutError: one did not within the communicator's timeout (the replay is then unusable).
        """
        try:
            start = self._wait(counters, ranks, target, what)
        except CollectiveTimeoutError:
            raise
        except BaseException as e:  # e.g. KeyboardInterrupt: the boards are out of step now
            self.comm.interrupted(what, e)
            raise
        hints.fence()  # nothing read of the peers' boards before their counters said it is there
        if start is not None:
            self.comm.waited += time.monotonic() - start

    def _wait(self, counters: list, ranks, target: int, what: str) -> float | None:
        """:meth:`wait`'s polls; returns when it began waiting (None: it did not)."""
        start = None
        mine = self.sleeping[self.rank]
        for r in ranks:
            word = counters[r]
            while not _reached(word, target):
                now = time.monotonic()
                if start is None:
                    start = now
                elif now - start > self.comm.timeout:
                    self._timed_out(what)
                elif now - start < self.spin:
                    os.sched_yield()
                elif _LIBC is None:
                    time.sleep(min(1e-3, (now - start) * 0.01))
                else:
                    seen = int(word[0])
                    hints.publish(mine, r + 1)
                    hints.fence()  # the flag is stored before the counter is read again (see _publish)
                    if not _reached(word, target):
                        # naps of 50 ms at most, never past the deadline: a timeout is raised on time
                        nap = min(0.05, max(1e-3, start + self.comm.timeout - now))
                        _futex(word, _FUTEX_WAIT, ctypes.c_int32(seen).value, nap)
                    mine[0] = 0
        return start

    def _timed_out(self, what: str) -> None:
        comm = self.comm
        comm.broken = (f"{what}: not every rank of {comm.size} arrived within timeout={comm.timeout:g} s (this is "
                       f"rank {comm.rank}); the replay can no longer communicate{errors.ABORT_HINT}")
        raise CollectiveTimeoutError(comm.broken)

    def close(self) -> None:
        """Unmap the boards (local; this rank's own segment is removed). Idempotent."""
        self.head_count = self.choice_count = self.pair_count = self.choices = self.sleeping = []
        self._bases = None  # (no board to reach: _check_open refuses a round)
        for r, arena in self._arenas.items():
            if arena is not self.arena:
                arena.close()
        self._arenas = {}
        if self.arena is not None:
            self.arena.close()  # also removes its name
            self.arena = None

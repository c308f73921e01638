"""Replay: a distributed replay whose sampling, collection and updates are SPMD collectives.

Every rank of ``comm`` owns one :class:`~gear_mpi.shard.Shard`. ``insert`` and ``insert_many`` are local.
Construction, ``sample``, ``update_priorities``, ``stats``, ``get_many`` and ``close`` are collectives: every rank
calls them, in the same order, like an ``MPI_Allreduce``. A rank may ask for any batch size (0 included), but
``window``, ``align`` and the call's ``mode`` must be the same on every rank. The mode given at construction is the
default; ``sample(..., mode=)`` picks another for one call (the plans of every mode work over the same shards).

A sample reads as its protocol: the ranks agree on the arguments (one allgather of a 14-value head: a status, the
call and its number, the call's arguments, the shard's mass, and the rate limiter's counts;
:mod:`gear_mpi.distributed.header`); the mode's plan (:mod:`gear_mpi.distributed.plans`) turns the header into the
items each owner serves each requester; the window transport (:mod:`gear_mpi.distributed.transport`) delivers a
48-byte *choice* per item and the windows, copied straight out of a node peer's shared memory or sent by MPI
(``force_alltoallv=True``: every window owned by another rank); the owners count the uses. The node fence
(:mod:`gear_mpi.distributed.node`) keeps an owner from overwriting a window a node peer still reads. Decentralized
and proportional: P(item) = weight / (total weight of all shards), exactly.

Failures: arguments are checked on every rank and agreed in the first collective of the call, so a bad argument on
one rank raises the same error (``"sample: rank R: ..."``) on every rank. A rank that does not arrive within
``timeout`` seconds -- at any collective, construction included -- makes the others raise
:class:`CollectiveTimeoutError`; the replay is then unusable. Every collective begins with a head of one size that
names the call and numbers it (:mod:`gear_mpi.distributed.calls`): ranks in different calls (rank 0 in ``stats``,
rank 1 in ``update_priorities``) all raise the same :class:`CollectiveError` naming each rank's call, and the
replay is then unusable too.
"""
from __future__ import annotations

import secrets
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from . import checkpoint, errors, keys as keyspace, stats as stats_schema
from .storage import budget
from .distributed import arguments, header, recovery, repeat, routing
from .batch import Batch, check_batch_size, check_out, check_window
from .distributed.calls import ReplayCalls, interrupt_breaks
from .storage.device import DeviceContext
from .feeds.replay_feeds import ReplayFeeds
from .distributed.node import NodeView
from .feeds.rate_limit import RateLimiter
from .distributed.prefetch import BatchIterator, ReplayPrefetch
from .stats import ReplayActivity, combine_activity, metered_sample, metered_update
from .distributed.header import MODES  # noqa: F401 (the modes Replay's docstrings name)
from .distributed.plans import Assignment, build_plans
from .checkpoint.replay_state import ReplayState
from .selection.selectors import Selector, Uniform
from .shard import Shard
from .warmup import warm_kernels
from .spec import TrajectorySpec, validate_priorities
from .distributed.transport import WindowTransport

FOLD_RANKS = 64  # a deferred update folds its counts (and keys) into one allgather up to this many ranks (O(ranks^2))

_BUILD = "Replay construction"  # names the construction's collectives in their errors


class Replay:
    """A replay sharded over the ranks of an mpi4py communicator (see the module docstring).

    It owns its shard, communicator, node view, transport and plans, and four parts it builds and calls
    explicitly: ``_feeds`` (:class:`~gear_mpi.feeds.replay_feeds.ReplayFeeds`: writers, actor ranks, the rate
    limiter), ``_prefetch`` (:class:`~gear_mpi.distributed.prefetch.ReplayPrefetch`: the batches() iterator
    that owns the replay while it runs), ``_activity`` (:class:`~gear_mpi.stats.ReplayActivity`: activity
    counters) and ``_state`` (:class:`~gear_mpi.checkpoint.replay_state.ReplayState`: the streams and window
    counters a checkpoint carries). A sample's header is :mod:`gear_mpi.distributed.header`'s.

    Args:
        spec: the columns of a trajectory; capacity_steps: steps each rank's shard holds.
        sampler: the selector (default :class:`Uniform`); mode: one of :data:`MODES`, the default of
            :meth:`sample` (each call may pick another).
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
        seed: fixes every rank's streams (each rank derives its own).
        timeout: seconds any collective waits for a rank, construction included.
        max_items, max_times_sampled: see :class:`~gear_mpi.shard.Shard`.
        memory: ``"shm"`` (POSIX shared memory), ``"private"`` (an anonymous private mapping; ``"numpy"`` is
            its deprecated name) or ``"file"`` (memory-mapped files under ``path``: a shard may exceed RAM;
            :mod:`gear_mpi.storage.file_arenas`); None: shared memory when several ranks share a node, else private.
        path: ``memory="file"``: an existing directory (may differ per rank) for this rank's ``rank-NNNNN/``.
        force_alltoallv: send every window owned by another rank through MPI.
        device: ``"cpu"``, ``"cuda"`` (the GPU of this rank's local rank) or ``"cuda:i"``.
        process_group, window_transport: for device replays, an existing torch.distributed group,
            and ``"nccl"`` or ``"mpi"`` (a CUDA-aware MPI) for windows between nodes.
        rate_limiter: a :mod:`gear_mpi.feeds.rate_limit` limiter over the whole replay (None: none);
            rate_limit_timeout: seconds a sample may wait for it (see :mod:`gear_mpi.feeds.replay_feeds`);
            writer_slack: episodes this rank's writers may stage beyond its insert allowance before their
            ``end_episode`` waits (None: the items of two sample calls; see :mod:`gear_mpi.feeds.replay_feeds`).
        lazy: only warn when the node cannot hold every rank's shard (:mod:`gear_mpi.storage.budget`); default: refuse.

    Collective: agrees on the arguments, a key tag and the node layout, and maps the node's
    shared memory; every step has the deadline ``timeout``.
    Raises:
        ValueError, TypeError: a bad argument on some rank, or ranks constructed with different arguments (on
            every rank, at once).
        MemoryBudgetError: the shards of a node would not fit its memory or /dev/shm (on every rank).
        StorageError: ``memory="file"``: a rank's ``path`` is missing or not writable, or its disk is full.
        CollectiveTimeoutError: a rank did not construct within ``timeout`` (on every other rank).
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, sampler: Selector | None = None, *,
                 mode: str = "decentralized", comm=None, seed: int = 0, timeout: float = 60.0,
                 max_items: int | None = None, max_times_sampled: int | None = None, memory: str | None = None,
                 force_alltoallv: bool = False, device: str = "cpu", process_group=None,
                 window_transport: str = "nccl", rate_limiter: RateLimiter | None = None,
                 rate_limit_timeout: float = 60.0, lazy: bool = False, path=None, writer_slack: int | None = None):
        # a bad argument on any rank raises on every rank (distributed.arguments), before the signature's agreement
        self.comm, device_kind, memory = arguments.agree(
            comm, timeout, f"{_BUILD} (arguments)", spec=spec, mode=mode, window_transport=window_transport,
            rate_limiter=rate_limiter, rate_limit_timeout=rate_limit_timeout, writer_slack=writer_slack,
            device=device, memory=memory)
        self.window_transport = window_transport
        sampler = Uniform() if sampler is None else sampler
        self.mode = mode
        self.force_alltoallv = bool(force_alltoallv)
        rank, size = self.comm.rank, self.comm.size
        signature = {"spec": spec.to_dict(), "capacity_steps": capacity_steps, "max_items": max_items,
                     "max_times_sampled": max_times_sampled, "sampler": repr(sampler), "mode": mode,
                     "force_alltoallv": self.force_alltoallv, "seed": seed, "memory": memory, "device": device_kind,
                     "window_transport": window_transport, "rate_limiter": repr(rate_limiter)}
        self.comm.agree_signature(signature, f"{_BUILD} (arguments)", "every rank must pass the same arguments")
        self.node = NodeView.join(self.comm, _BUILD)
        self.shard = None
        try:
            self.node.share_cores()
            if memory is None:
                memory = "shm" if self.node.size > 1 else "private"
            budget.enforce(self.comm, spec, capacity_steps, max_items, sampler, memory, self.node.size, lazy, _BUILD)
            tag = np.array([secrets.randbits(keyspace.TAG_BITS)], np.int64)
            tag = int(self.comm.bcast(tag, 0, f"{_BUILD} (key tag)")[0])
            streams = np.random.SeedSequence(seed).spawn(size)[rank].spawn(2)
            # the GPU follows the local rank (rank within the node) unless device names one
            self.device = DeviceContext(device, self.node.local_rank) if device_kind == "cuda" else None
            self.shard = self.comm.agreed(lambda: Shard(  # a rank's full disk or bad path: raised on every rank
                spec, capacity_steps, sampler, max_items=max_items, max_times_sampled=max_times_sampled, memory=memory,
                seed=streams[0], rank=rank, tag=tag, device_context=self.device, path=path), f"{_BUILD} (shard)", Shard.close)
            self.rng = np.random.Generator(np.random.PCG64(streams[1]))
            # the same on every rank: per-requester shard counts (decentralized) are drawn from it
            shared_seed = np.random.SeedSequence(seed, spawn_key=(1 << 30,))
            self.shared_rng = np.random.Generator(np.random.PCG64(shared_seed))
            self.node.attach(self.shard, memory, self.force_alltoallv, self.device, _BUILD)
            self.transport = WindowTransport(self.comm, self.node, self.shard, self.device, window_transport,
                                             process_group)
        except BaseException:
            self.node.close()
            if self.shard is not None:
                self.shard.close()
            raise
        self.plans = build_plans(self.comm, self.shard, self.rng, self.shared_rng)  # every mode's, picked per call
        self.calls = ReplayCalls(self.comm, self.node.board)  # the heads of its collectives (distributed.calls)
        # one rank on the host: a sample is its shard's (every mode draws from the one shard, nothing to agree)
        self._solo = size == 1 and self.device is None
        if self.device is None:  # the first sample then costs what later ones do (gear_mpi.warmup.warm_kernels)
            warm_kernels(spec, sampler)
            none = np.zeros(size, np.int64)
            self.transport.exchange(self.shard.make_choices(none[:0], 1, 0, 1.0, 1.0), none, none, 1, local=True)
            self.transport.copy_seconds = 0.0  # the warm-up is not a sample's copy time (stats()["activity"])
        self.spec = spec
        self.selector = sampler
        self.closed = False
        self.fold_keys = 0  # keys per rank the next deferred update's allgather carries (routing.route_deferred)
        # the parts (local objects): each takes what it reads, and the replay calls them explicitly
        self._state = ReplayState(self.rng, self.shared_rng, mode=mode, comm=self.comm,
                                  force_alltoallv=self.force_alltoallv, device=self.device, shard=self.shard)
        self._prefetch = ReplayPrefetch()
        self._checkpoints = None  # checkpoint.background.BackgroundCheckpoints, from checkpoint_every
        self._repeat: dict = {}  # id(out=) -> distributed.repeat.SampleRecord of a call into it
        self.loaded_from = None  # the checkpoint load_latest read (a pathlib.Path), else None
        self._feeds = ReplayFeeds(self.shard, rank, size, self.settle, rate_limiter, rate_limit_timeout,
                                  writer_slack)
        self._activity = ReplayActivity(self.shard, self.comm, self.transport, spec.step_bytes + 1, self._feeds)

    # ---- local operations -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the replay's communicator."""
        return self.comm.rank

    @property
    def ranks(self) -> int:
        """Ranks in the replay's communicator (not items: ``len(replay)`` counts this rank's, and
        ``stats()["total"]["items"]`` the replay's)."""
        return self.comm.size

    @property
    def size(self) -> int:
        """Deprecated name of :attr:`ranks` (it was read as a number of items); warns."""
        warnings.warn("Replay.size is the number of ranks: use Replay.ranks (len(replay) is this rank's live "
                      "items)", DeprecationWarning, stacklevel=2)
        return self.comm.size

    @property
    def torch_comm(self):
        """The torch.distributed communicator of device window exchanges (None when unused)."""
        return self.transport.torch_comm

    @property
    def _epoch(self) -> int:
        return self.node.epoch

    @property
    def windows_shared(self) -> int:
        """Windows this rank's samples copied from a node peer's shared memory (local; checkpointed)."""
        return self._state.windows_shared

    @property
    def windows_mpi(self) -> int:
        """Windows this rank's samples received through MPI (local; checkpointed)."""
        return self._state.windows_mpi

    @property
    def rate_limiter(self) -> RateLimiter | None:
        """The rate limiter over the whole replay (None: none)."""
        return self._feeds.rate_limiter

    @property
    def rate_limit_timeout(self) -> float:
        """Seconds a sample may wait for the rate limiter."""
        return self._feeds.rate_limit_timeout

    def __len__(self) -> int:
        """Live trajectories in this rank's shard (local, O(1); 0 once closed); see :meth:`stats` for the total."""
        return len(self.shard)

    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0, *, check_finite: bool = False) -> int:
        """Add one trajectory to this rank's shard (local; see :meth:`Shard.insert`).

        Args:
            trajectory: column name -> array of ``length`` steps.
            priority: its selection weight (non-negative, finite).
            check_finite: refuse NaN and infinite step values (InvalidTrajectoryError naming the column and
                step; nothing added). Off by default, as in numpy: then it costs nothing.
        Returns:
            Its key (unique over the replay).
        Raises:
            InvalidTrajectoryError, InvalidPriorityError: a bad trajectory or priority.
            CollectiveTimeoutError: a node peer never finished reading the last sample (node fence).
        Cost: the node fence (free after a collective), then O(length) copy and an index update.
        """
        self.settle()
        return self.shard.insert(trajectory, priority, check_finite=check_finite)

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None, *,
                    check_finite: bool = False) -> np.ndarray:
        """Add trajectories to this rank's shard (local; see :meth:`Shard.insert_many`).

        Args:
            trajectories: a sequence of trajectories (see :meth:`insert`).
            priorities: one per trajectory (None: all 1).
            check_finite: as :meth:`insert`.
        Returns:
            Their keys (int64).
        Raises:
            InvalidTrajectoryError, InvalidPriorityError: a bad trajectory or priority (nothing is added).
            CollectiveTimeoutError: see :meth:`insert`.
        Cost: the node fence, then one batched copy and index update.
        """
        self.settle()
        return self.shard.insert_many(trajectories, priorities, check_finite=check_finite)

    def insert_packed(self, columns: Mapping[str, Any], lengths: Any, priorities: Any = None, *,
                      check_finite: bool = False, casting: str = "safe") -> np.ndarray:
        """Add trajectories laid end to end (one ``[sum(lengths), *shape]`` array per column) to this rank's
        shard: local, as :meth:`Shard.insert_packed` (its arguments, ``casting`` included, checks and errors,
        ``check_finite`` as :meth:`insert`; nothing is added on an error), after the node fence (:meth:`insert`).
        Returns their keys (int64)."""
        self.settle()
        return self.shard.insert_packed(columns, lengths, priorities, check_finite=check_finite, casting=casting)

    # ---- feeds: writers and actor ranks (gear_mpi.feeds.replay_feeds) -------------------------
    def writer_address(self) -> str:
        """This rank's ingest point, for :class:`gear_mpi.Writer` processes on this node (local).

        Returns:
            A string, valid while the replay is open (the name of a small shared-memory segment, made
            on the first call).
        Raises:
            RuntimeError: the replay is closed.
        Cost: the first call makes a 64 KiB segment; later calls O(1).
        """
        self._check_open()
        return self._feeds.writer_address()

    def accept_remote(self, comm) -> None:
        """Take episodes from :class:`gear_mpi.MpiWriter` actor ranks of ``comm`` from now on (local). ``close``
        then tells the actors and waits up to ``timeout`` for their goodbyes (see :mod:`gear_mpi.feeds.remote`).

        Args:
            comm: an mpi4py communicator holding this rank and its actors (e.g. ``MPI.COMM_WORLD``).
        Raises:
            RuntimeError: the replay is closed. TypeError: not a communicator.
        """
        self._check_open()
        self._feeds.accept_remote(comm, self.comm.timeout)

    def ingest(self) -> int:
        """Move the writers' and actor ranks' ended episodes into this rank's shard now (local), within
        the rate limiter's insert budget.

        Returns:
            How many trajectories entered.
        Raises:
            CollectiveTimeoutError: a node peer never finished reading the last sample (node fence).
        Cost: O(writers) counter reads; per writer with episodes, one copy of them into the shard.
        """
        self._check_open()
        return self._feeds.feed()

    # ---- sample: agree on the arguments -> plan -> exchange -> finish ---------------------------
    def sample(self, batch_size: int, window: int | None = None, align: str = "random", *,
               mode: str | None = None, out: Batch | None = None) -> Batch:
        """Collective: every rank receives ``batch_size`` windows drawn from the whole replay.

        Args:
            batch_size: windows for this rank (may differ between ranks; 0 allowed).
            window: steps per window (None: the spec's max_length); the same on every rank.
            align: ``"random"``, ``"head"`` or ``"tail"``; the same on every rank.
            mode: this call's mode, one of :data:`MODES` (None: the replay's); the same on every rank. On a replay
                built with ``mode="local"``, a call in its own mode does not communicate (so it cannot check the
                others' modes); every other call agrees on the mode first, a per-call ``"local"`` included (then
                each rank samples its own shard).
            out: a host batch to fill again (a batch an earlier call returned, of ``batch_size`` windows of ``window``
                steps), so a training loop allocates nothing per call; None: a new batch.
        Returns:
            A :class:`Batch` (``out`` when given; on the GPU for a device replay).
        Raises:
            ValueError: a bad argument on some rank (a batch larger than its machine's memory included), or ranks
                asking for different modes (the same error on every rank).
            EmptyReplayError: items are asked and none can be selected (local: of this rank's shard).
            RateLimitTimeoutError: the rate limiter held the call past ``rate_limit_timeout`` (every rank).
            CollectiveError: another rank is in another collective call (on every rank, naming both).
            CheckpointError: a rank's columns map a checkpoint (``load(mmap=True)``) that another process
                has written or truncated since (every rank; docs/CHECKPOINTS.md).
            CorruptDataError: a window read a damaged compressed chunk (every rank). TypeError: ``out`` not a Batch.
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.

        First the rank's writers are drained (within its insert budget); with a rate limiter that does not admit the
        call, every rank repeats drain + header allgather, backing off, until it does. Cost per call (decentralized,
        proportional): two rounds of latency -- an allgather of 112 bytes per rank (the head: status, call, header),
        then, in flight together, one alltoallv of 48 bytes per item and one alltoallv per column of ``W S`` bytes
        per window owned on another node (all ranks on one node: no MPI call, both rounds through shared memory,
        :class:`~gear_mpi.distributed.node.NodeBoard`). A counter published at the end (read by an owner before it
        next writes its shard; see the module docstring) keeps owners from overwriting windows that node peers still
        copy. Selection on the owner: O(items log n); copies: each delivered byte once on a node, twice (pack + MPI)
        across nodes. A call repeated on one node (into the same ``out=``, or again into a new batch) skips the
        checks the first one made, each board round one kernel call (:mod:`gear_mpi.distributed.repeat`).
        One rank on the host: no header, plan or exchange -- the arguments are checked, the writers drained
        and the rate limiter asked as above, then the shard samples itself (:meth:`Shard.sample`), in every mode.
        """
        rec = self._repeat.get(id(out))  # the same out= and arguments as a recorded call: no checks again
        if rec is not None and rec.same(out, batch_size, window, align, mode) and rec.usable(self):
            return repeat.sample_counted(self, rec)  # (checked open, counted and guarded as the decorators below do)
        return self._sample_checked(batch_size, window, align, mode, out)

    @metered_sample
    @interrupt_breaks("sample")
    def _sample_checked(self, batch_size, window, align: str, mode, out) -> Batch:
        """:meth:`sample` for every call but a repeated one: the arguments checked, mapped columns held."""
        self._check_open()
        with self.shard.hold(strict=False) as problem:  # (a CheckpointError agreed with the arguments' errors)
            batch = self._sample(batch_size, window, align, mode, out, problem)
        repeat.remember(self, out, batch_size, window, align, mode)  # for the next such call (when it qualifies)
        return batch

    def _sample(self, batch_size: int, window: int | None, align: str, mode: str | None, out: Batch | None,
                problem: Exception | None) -> Batch:
        if self.mode == "local" and mode in (None, "local"):  # no communication
            if problem is not None:
                raise problem
            return self._sample_local(batch_size, window, align, out)
        if self._solo and self._checkpoints is None:  # one host rank: its shard is all, nobody to disagree with
            if problem is not None:  # (a mapped checkpoint changed: CheckpointError) worded as an agreed error
                raise type(problem)(f"sample: rank 0: {problem}") from problem
            try:
                header.mode_code(self.mode if mode is None else mode)
                check_out(self.spec, self.device is not None, out, check_batch_size(batch_size),
                          check_window(self.spec, window, align)[0])
            except (ValueError, TypeError) as e:  # worded as an agreed error (MpiComm.raise_agreed)
                raise type(e)(f"sample: rank 0: {e}") from e
            return self._sample_local(batch_size, window, align, out)
        err, mode = problem, self.mode if mode is None else mode
        try:
            batch_size = check_batch_size(batch_size)
            window, code = check_window(self.spec, window, align)
            mcode = header.mode_code(mode)
            check_out(self.spec, self.device is not None, out, batch_size, window)
        except Exception as e:  # agreed below, so every rank raises it
            err, batch_size, window, code, mcode = e, 0, 0, 0, 0
        # the writers drain; the header is agreed (over the node board when there is one), again while the
        # rate limiter holds the call
        ck = self._checkpoints  # background checkpoints: the vote rides in the header, the start follows it
        head = header.agree(self._feeds, self.shard, self.calls, err, batch_size, window, code, mcode,
                            0.0 if ck is None else ck.vote())
        if header.check_mode(head) == "local":  # agreed: each rank samples its own shard
            batch = self._sample_local(batch_size, window, align, out)
        else:
            self.node.begin_sample()
            try:
                header.check_header(head, self.selector.proportional)
                batch = self._exchange(self.plans[mode].assign(head), window, code, mode, out)
            finally:
                self.node.publish()  # this rank's reads of its node peers' memory for this sample are over
        if ck is not None:
            ck.after_sample(head, header.CHECKPOINT)
        return batch

    def _sample_local(self, batch_size: int, window: int | None, align: str, out: Batch | None = None) -> Batch:
        """This rank's own shard serves it; no communication (on the CPU the shard samples itself; a rate
        limiter sees this rank's counts only)."""
        if self.device is None:
            if not self._feeds.idle:  # the writers drain and the rate limiter decides, on this rank's row alone
                header.agree(self._feeds, self.shard, None, None, check_batch_size(batch_size), 0, 0,
                             header.mode_code("local"))
            return self.shard.sample(batch_size, window, align, out)
        batch_size = check_batch_size(batch_size)
        window, code = check_window(self.spec, window, align)
        check_out(self.spec, self.device is not None, out, batch_size, window)
        head = header.agree(self._feeds, self.shard, None, None, batch_size, window, code, header.mode_code("local"))
        return self._exchange(self.plans["local"].assign(head), window, code, "local")

    def _exchange(self, plan: Assignment, window: int, code: int, mode: str, out: Batch | None = None) -> Batch:
        """Owners make the choices of the items they serve, the transport delivers choices and windows,
        and the owners count the uses of what they served."""
        choices = self.shard.make_choices(plan.slots, window, code, plan.mass, plan.min_weight)
        context = self.shard.frame_context(plan.slots, choices) if self.spec.derived else None
        batch = self.transport.exchange(choices, plan.send_counts, plan.recv_counts, window,
                                        local=mode == "local", out=out, counts=plan.counts, context=context)
        self._state.count_windows(int(plan.recv_counts @ self.node.peer_direct),
                                  int(plan.recv_counts @ self.node.remote))
        self.shard.after_sampling(plan.slots)
        return batch

    def batches(self, batch_size: int, window: int | None = None, align: str = "random", *,
                mode: str | None = None, prefetch: int = 2, limit: int | None = None,
                recycle: bool | str = "auto") -> BatchIterator:
        """Collective in effect: an iterator of batches sampled ``prefetch`` ahead by a background thread
        (:mod:`gear_mpi.distributed.prefetch`: the schedule, staleness of updates, and shutdown). Every rank
        iterates in step; give priority updates with ``iterator.update_priorities``; use it as a context manager.

        Args:
            batch_size, window, align, mode: as :meth:`sample`, for every batch.
            prefetch: batches sampled ahead (0: each when asked for). limit: batches to give (None: no end).
            recycle: refill a ring of ``prefetch + 2`` batches (``sample(out=...)``) instead of allocating a
                new one per step (host replays): the background thread then takes no page faults on fresh
                memory. A batch is refilled once the loop has taken two more: with ``"auto"`` (default) only
                if nothing outside the iterator references it or any of its tensors (else a new one takes
                its place); with True always (copy what the loop keeps); with False never.
        Returns:
            The :class:`~gear_mpi.distributed.prefetch.BatchIterator`.
        Raises:
            ValueError: a bad ``prefetch``/``limit``/``recycle``, ``recycle=True`` on a device replay.
            RuntimeError: the replay is closed or already iterated, or MPI lacks THREAD_MULTIPLE.
        Cost: one thread; each batch costs what :meth:`sample` does, hidden behind the training step.
        """
        self._check_open()
        return self._prefetch.start(self, batch_size, window, align, mode, prefetch, limit, recycle)

    def settle(self) -> None:
        """The node fence (local): before this rank writes its shard, wait until every node peer has
        finished reading its windows of the last sample. Free when a collective has been passed
        since the last sample; otherwise a spin on a few shared counters, with the deadline.

        Raises:
            CollectiveTimeoutError: a node peer did not finish within ``timeout``.
            RuntimeError: a batches() iterator owns the replay (called from another thread).
        """
        self._prefetch.check_owner()
        self.node.settle()

    # ---- priorities ---------------------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Collective: route each key's new priority to its owner.

        Args:
            keys: keys issued by this replay (any rank's), e.g. ``batch.keys``.
            priorities: one new priority per key (non-negative, finite).
        Returns:
            How many of this rank's keys were applied (stale keys are dropped and counted in :meth:`stats`).
        Raises:
            InvalidKeyError, InvalidPriorityError: a bad key or priority on some rank (on every rank).
            CollectiveError: another rank is in another collective call (on every rank, naming both).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.

        Cost: the head, one allgather (status, call, whether the rank's keys are all its own and, up to 11 ranks,
        how many it has for each owner; a row on the node board when every rank is on one node); then, unless
        every rank holds only its own keys (as after a local sample), one alltoall of counts (more than 11 ranks),
        one alltoallv of 16 bytes per key, one alltoall of applied counts -- on one node up to 11 ranks, the keys
        through the node board instead (each rank's posted on its board, collected by their owners) and the
        applied counts as a head row: no MPI call; O(n) on the owner plus one batched index update. Duplicate
        keys: the highest rank's value wins, and within a rank the last one.
        """
        return self._update(keys, priorities)

    @metered_update
    @interrupt_breaks("update_priorities")
    def _update(self, keys: Any, priorities: Any, deferred: bool = False, problem: Exception | None = None) -> int:
        """:meth:`update_priorities`; ``problem``: this rank's error known already (a ReplicaSampler reporter's refused
        update), agreed as a bad key's would be; ``deferred`` (every rank's batches() thread): up to ``FOLD_RANKS``
        ranks, :func:`routing.route_deferred`: one allgather in flight with the head carries the counts, and the
        keys too once their count is known (``fold_keys``); the result is how many keys this rank's shard applied.
        A deferred update's head is an ``"update_priorities (batches)"`` call: a plain update meeting it is a
        mismatch (:mod:`gear_mpi.distributed.calls`)."""
        self._check_open()
        err, fold = problem, deferred and self.ranks <= FOLD_RANKS
        try:
            self._feeds.feed()
            keys, owner, counts = routing.check_keys(keys, self.shard.tag, self.ranks, self.shard.store.max_items)
            pr = validate_priorities(priorities, len(keys))
        except Exception as e:
            err, keys, pr, owner, counts = e, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), None
        if fold:
            applied, self.fold_keys = routing.route_deferred(self.calls, self.shard, err, keys, owner, pr,
                                                             self.fold_keys, self.settle)
            return applied
        return routing.update_routed(self.calls, self.shard, err, keys, owner, counts, pr, "update_priorities "
                                     "(batches)" if deferred else "update_priorities", not deferred, self.settle)

    @interrupt_breaks("clear")
    def clear(self) -> None:
        """Collective: empty every rank's shard (:meth:`Shard.clear`): every key issued so far is stale, the
        memory is kept, the counters go on (items cleared count as removed). What this rank's writers had
        staged before the call is drained first and cleared with the rest.

        Raises:
            RuntimeError: the replay is closed (on this rank).
            CollectiveError: another rank is in another collective call (on every rank, naming both).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        Cost: the head (status and call: one allgather, or a row on the node board), the node fence,
        O(items held) table work.
        """
        self._check_open()
        err = self._drain_writers()
        self.calls.agree(err, "clear")
        self.settle()
        self.shard.clear()

    # ---- trajectories by key ----------------------------------------------------------------------
    def get(self, key: int) -> dict[str, np.ndarray]:
        """A trajectory of this rank's shard (local, O(length) copy; any rank's keys: :meth:`get_many`).

        Args:
            key: a key this rank's shard issued.
        Returns:
            Column name -> array of its steps.
        Raises:
            StaleKeyError: the trajectory was evicted or removed; InvalidKeyError: not this shard's key.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated since.
        """
        return self.shard.get(key)

    @interrupt_breaks("get_many")
    def get_many(self, keys: Any) -> list[dict[str, np.ndarray] | None]:
        """Collective: whole trajectories by key, whichever rank owns them (every rank calls it, with
        its own keys; an empty list is fine).

        Args:
            keys: keys issued by this replay, of any rank (e.g. ``batch.keys``).
        Returns:
            One entry per key, in the given order: column name -> ``[L, *shape]`` array on the host, or
            None where the key is stale (its trajectory evicted or removed).
        Raises:
            TypeError, InvalidKeyError: keys not integers, or not this replay's, on some rank (on every rank).
            CollectiveError: another rank is in another collective call (on every rank, naming both).
            CheckpointError: as :meth:`sample` (mapped columns changed by another process; every rank).
            CorruptDataError: a trajectory reads a damaged compressed chunk (every rank).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        Cost: the head (one allgather, or a row on the node board), then :func:`gear_mpi.distributed.routing.fetch`: an alltoall of counts, two
        alltoallvs of 8 bytes per key, one alltoallv per column of every asked step; plain MPI even
        between node peers (each step is packed by its owner, then sent).
        """
        self._check_open()
        with self.shard.hold(strict=False) as problem:  # mapped columns: see sample()
            return routing.get_many(self.calls, self.shard, keys, problem)

    def _drain_writers(self) -> Exception | None:
        """Drain this rank's writers (:meth:`ReplayFeeds.feed`) before a collective; returns the error instead of
        raising it, for the caller to agree so that every rank raises it. Local."""
        try:
            self._feeds.feed()
        except Exception as e:
            return e
        return None

    # ---- stats and lifetime -------------------------------------------------------------------
    @interrupt_breaks("stats")
    def stats(self) -> dict[str, Any]:
        """Collective: every rank's figures, their totals and the balance (the schema of
        :mod:`gear_mpi.stats`, tabled in docs/guide/statistics.md; a shard's ``stats()`` uses the same names).

        Returns:
            ``{"ranks", "mode" (the default), "balance" (largest shard / mean shard, in items),
            "total": {figure: sum (ingested_age: the largest)}, "per_rank": {figure: [rank 0's, rank 1's, ...]}}``
            for the figures of ``stats.REPLAY_FIGURES`` (items, live_steps, steps_used, capacity_steps, weight,
            inserted, evicted, removed, sampled, stale_updates, stored_bytes, raw_bytes, reserved_bytes,
            windows_shared, windows_mpi, ingested, writers, staged, staged_steps, writers_draining, ingested_age),
            plus ``"sample_to_insert_ratio"``, ``"rate_limiter"`` (its repr) and ``"activity"`` (counters for
            :func:`gear_mpi.stats.rates`: ``{"per_rank": ..., "total": ...}``).
        Raises:
            CollectiveError: another rank is in another collective call (on every rank, naming both).
            CollectiveTimeoutError: a rank did not arrive within ``timeout``.
        Cost: drains this rank's writers (within the insert budget), then the head (status and call) and,
        in flight with it, one allgather of 37 float64 per rank (21 figures and 16 activity counters).
        """
        self._check_open()
        err = self._drain_writers()
        n = len(stats_schema.REPLAY_FIGURES)
        try:  # a rank's failure to read its figures is agreed too: the others must not wait for its row
            mine = self.shard.stats()
            mine.update(windows_shared=self._state.windows_shared, windows_mpi=self._state.windows_mpi,
                        **self._feeds.figures())
            row = np.array(stats_schema.row(mine) + self._activity.row(), np.float64)
        except Exception as e:  # noqa: BLE001 -- raised below on every rank
            err, row = err or e, np.zeros(n + len(stats_schema.ACTIVITY_FIGURES))
        _, table = self.calls.agree(err, "stats", payload=row)  # the row rides behind the head
        self.settle()
        out = stats_schema.combine(table[:, :n], self.mode)
        total = out["total"]
        out["sample_to_insert_ratio"] = total["sampled"] / total["inserted"] if total["inserted"] else float("nan")
        out["rate_limiter"] = repr(self._feeds.rate_limiter)
        out["activity"] = combine_activity(table[:, n:])
        return out

    def activity_row(self) -> list[float]:
        """This rank's activity counters in :data:`gear_mpi.stats.ACTIVITY_FIGURES` order (local, O(1); safe
        from any thread: it only reads numbers; :class:`~gear_mpi.stats.ReplayActivity`).

        Returns:
            The values as floats.
        """
        return self._activity.row()

    # ---- checkpoints (gear_mpi.checkpoint) ------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's replay-level state (local, JSON-serialisable): the replay stream (``"rng"``),
        the shared stream (``"shared_rng"``, the same on every rank) and the window counters.

        Returns:
            ``{"rng", "shared_rng", "windows_shared", "windows_mpi"}``.
        """
        return self._state.state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (local; ``"shared_rng"`` optional: kept when absent).

        Args:
            state: a mapping with ``"rng"``, ``"windows_shared"``, ``"windows_mpi"`` and optionally
                ``"shared_rng"``.
        Raises:
            KeyError: a required entry is missing; ValueError/TypeError: a stream state of another kind.
        """
        self._state.load_state(state)

    def describe(self) -> dict[str, Any]:
        """How this replay runs, for a checkpoint's manifest (local).

        Returns:
            ``{"mode", "timeout", "force_alltoallv", "device": "cpu" | "cuda", "memory": the shard
            arena's kind ("private" | "shm")}``.
        """
        return self._state.describe()

    @interrupt_breaks("save")
    def save(self, path, progress: bool | None = None) -> None:
        """Collective: write a crash-safe, checksummed checkpoint of every shard to directory ``path``.

        Args:
            path: the checkpoint directory (its parent must exist; an earlier checkpoint there is replaced).
            progress: progress on rank 0's stderr (None: unless ``GEAR_MPI_PROGRESS=0``; see :mod:`gear_mpi.progress`).
        Raises:
            CheckpointError: a file problem, or (``load(mmap=True)``) a rank's mapped checkpoint changed by
                another process (on every rank); CollectiveTimeoutError: a rank did not arrive.
        Cost: see :func:`gear_mpi.checkpoint.save`.
        """
        checkpoint.save(self, path, progress)

    def checkpoint_every(self, directory, seconds: float | None = 60.0, keep: int = 2, *, segment_bytes: int = 16 << 20,
                         copy_limit: int = 1 << 30, write_rate: float | None = None, cpu_share: float | None = 0.02,
                         priority: str = "low"):
        """Collective: take incremental checkpoints in the background, about every ``seconds``, into
        ``directory/ckpt-NNNNNNNN`` (:mod:`gear_mpi.checkpoint.background`; docs/guide/faults.md).

        The decision rides on ``sample``'s header; after the sample that starts one, each rank copies its table
        and index, and a thread of low priority writes the ring segments (of ``segment_bytes``) and table blocks
        changed since the previous checkpoint, from memory (an insert copies a segment before overwriting it
        while it is still to be written), hard-linking the others (no MPI). Each is complete on its own once its
        manifest exists; the newest ``keep`` are kept.

        Args:
            directory: created if missing; on a file system every rank sees; the same on every rank (compared
                after ``os.path.abspath``).
            seconds: the interval (None: only ``handle.now()``). keep: complete checkpoints kept (>= 1).
            segment_bytes: the size of a ring segment file. copy_limit: bytes inserts may copy per checkpoint;
                past it an insert writes the segment itself. write_rate, cpu_share: bytes/s and the fraction of
                a core a rank's thread uses at most (None: no limit). priority: ``"low"``, ``"nice"`` or ``"normal"``.
        Returns:
            The :class:`~gear_mpi.checkpoint.background.BackgroundCheckpoints` handle (``now``, ``wait``, ``stop``).
        Raises:
            TypeError, ValueError: bad or differing arguments, or a handle already attached (every rank).
            CheckpointError: the directory cannot be created.
        Cost: one head allgather; per insert an O(1) note of the segments it writes.
        """
        return checkpoint.background.start(self, directory, seconds, keep, segment_bytes, copy_limit,
                                           write_rate, cpu_share, priority)

    @classmethod
    def load_latest(cls, directory, comm=None, **overrides):
        """Collective: load the newest complete checkpoint in ``directory`` (see :meth:`checkpoint_every`), on
        this communicator's ranks (any number: the same resharding as :meth:`load`).

        Args:
            directory: a directory of checkpoints; comm, overrides: as :meth:`load`.
        Returns:
            ``(replay, key_map)`` as :meth:`load` (``replay.loaded_from`` is the checkpoint's path), or
            ``(None, None)`` on every rank when the directory holds no complete checkpoint yet.
        Raises:
            CheckpointError: the ranks see different newest checkpoints, or it is damaged (every rank).
        Cost: a directory listing and manifest reads, one small allgather, then :meth:`load`.
        """
        path = checkpoint.agree_latest(directory, comm, overrides.get("timeout", 60.0))
        if path is None:
            return None, None
        replay, key_map = checkpoint.load(path, comm, cls, **overrides)
        replay.loaded_from = path
        return replay, key_map

    @classmethod
    def load(cls, path, comm=None, **overrides) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
        """Collective: restore a checkpoint onto ``comm`` (any number of ranks).

        Args:
            path: a checkpoint directory written by :meth:`save`.
            comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
            overrides: constructor arguments to change (e.g. ``mode``, ``timeout``, ``device``); ``mmap=True``
                maps the saved columns instead of reading them, ``verify`` (see :func:`gear_mpi.checkpoint.load`).
        Returns:
            ``(replay, key_map)``: the replay and the map of old keys to new keys.
        Raises:
            CheckpointError: a missing, partial or corrupted checkpoint (on every rank).
        Cost: see :func:`gear_mpi.checkpoint.load`.
        """
        return checkpoint.load(path, comm, cls, **overrides)

    def recover(self, checkpoint, **overrides) -> "recovery.Recovery":
        """Collective over the survivors after a rank died (ULFM): revoke and shrink the communicator; a new replay
        keeps each survivor's shard and restores the dead ranks' from ``checkpoint`` (their later inserts are lost).

        Args: checkpoint: this replay's newest checkpoint directory (None: none); overrides: sizes etc.
        Returns: a :class:`~gear_mpi.Recovery` (``replay``, ``key_map``, ``comm``: use it from now on).
        Raises: RecoveryError: no ULFM (MPICH): at once on every rank, nothing changed; CheckpointError etc.:
        as :meth:`load`. Cost and details: :func:`gear_mpi.distributed.recovery.recover`.
        """
        return recovery.recover(self, checkpoint, **overrides)

    def close(self) -> None:
        """Collective: wait for every rank, unmap the node's shared memory, free the shard.

        If the communicator is broken (after a timeout or a mismatch of calls) it closes locally only. Idempotent.
        Its barrier runs on a communicator of its own, never matched with another call: a rank that closes
        while another makes a collective call makes both time out (no head names the calls).
        Raises:
            CollectiveTimeoutError: a rank did not arrive within ``timeout`` (this rank still closes).
            The error of an active batches() iterator's thread (as ``iterator.close()``), once this rank closed.
        """
        if self.closed:
            return
        error = self._prefetch.close()  # an active batches() iterator finishes its allowed samples first
        if self._checkpoints is not None:  # a checkpoint being written finishes (bounded: a dead peer's never)
            self._checkpoints.detach(self.comm.timeout)
        self.closed = True
        try:
            if self.comm.broken is None and self.ranks > 1:
                self.settle()
                self.node.closing_barrier()  # on a communicator of its own: never matched with a sample
        finally:
            self._feeds.close()
            self.transport.close()
            self.node.close()
            self.shard.close()
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Replay is closed")
        self._prefetch.check_owner()
        self.comm.check_usable()

    __reduce_ex__ = errors.not_copyable("a Replay (its shards live on MPI ranks)", "save it with replay.save(path) and "
                                        "Replay.load(path, comm); replay.shard pickles as a copy of this rank's items")

    def __enter__(self) -> "Replay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Replay(rank={self.rank}/{self.ranks}, mode={self.mode!r}, sampler={self.selector!r}, "
                f"items_here={len(self.shard)})")

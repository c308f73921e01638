"""Model-parallel groups, and one replica's batch delivered to every rank of that replica that needs it.

A job that trains with tensor parallelism (T ranks hold slices of each layer) and pipeline
parallelism (P stages hold consecutive layers) runs ``D = world / (T P)`` model replicas.
:func:`parallel_groups` builds the three communicators of Megatron-LM and DeepSpeed from the
world, in their default rank order (``order="tp-dp-pp"``: tensor fastest, then data, pipeline
slowest -- Megatron's ``tp-cp-ep-dp-pp`` without context/expert parallelism, DeepSpeed's
``PipeModelDataParallelTopology`` axes ``pipe, data, model``)::

    rank = pp * (D T) + dp * T + tp

Any other order of the three names may be given (``"tp-pp-dp"`` puts each replica on consecutive
ranks: ``rank = dp * (P T) + pp * T + tp``).

One batch per replica: every tensor peer of the stages that read the batch (the first stage
reads the inputs, the last one the targets, keys and importance weights; ``stages="ends"``) must
see the same rows. :class:`ReplicaSampler` samples once per replica -- on its *leader*, the rank
with ``tp = 0, pp = 0`` -- and broadcasts that batch (every column, mask, keys, probabilities,
weights, lengths: numpy buffers in host memory, MPI ``Ibcast``) over the replica's *delivery
group*. The replay is sharded one of two ways (``groups.replay_comm(sharding)`` is its ``comm``):

- ``"replica"``: only the leaders hold shards, one each, a replay over the data-parallel group
  of the leaders (D ranks). The sample is collective over the leaders only. Memory: the stored
  experience lives on D ranks (each holds 1/D of it); the other ranks hold none. Inserts go to
  the leaders (writers of other ranks' processes attach to a leader's ``writer_address``).
- ``"world"``: every rank holds a shard, a replay over the whole world. The sample is collective
  over the world; only the leaders ask for rows (the others ask for 0), then the leaders
  broadcast. Memory per rank is 1/(T P) of the ``"replica"`` layout's, and every rank's own
  actors insert locally; the price is a sample collective over T P times more ranks (a larger
  allgather header, more peers in each exchange) and windows that may come from any rank.

Choose ``"replica"`` when the leaders have the memory (fewer ranks in each collective, less
latency); ``"world"`` when the experience does not fit on D ranks, or when every rank collects
experience and should keep it where it was made. In both layouts the rows a replica receives
are drawn exactly as a plain sample of that replay draws them (P(item) = w_i / sum w).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import errors
from ..batch import Batch
from ..keys import as_key_array
from ..spec import TrajectorySpec, validate_priorities, whole_number
from .calls import interrupt_breaks
from .comm import MpiComm, error_code, message_bytes, message_text, with_deadline

AXES = ("tp", "dp", "pp")
#: errors a leader's failed sample is re-raised as on its peers (the most specific class that fits)
_DELIVERED = (Exception, ValueError, TypeError, KeyError, RuntimeError, TimeoutError, errors.GearError,
              errors.InvalidTrajectoryError, errors.InvalidPriorityError, errors.InvalidKeyError,
              errors.StaleKeyError, errors.EmptyReplayError, errors.CollectiveError,
              errors.CollectiveTimeoutError, errors.RateLimitTimeoutError)
_MESSAGE = 1024


def _positive_int(name: str, v: Any) -> int:
    if not whole_number(v):
        raise ValueError(f"parallel_groups: {name} must be an integer >= 1, got {v!r}")
    return int(v)


def _parse_order(order: Any) -> tuple[str, ...]:
    names = tuple(str(order).split("-")) if isinstance(order, str) else ()
    if sorted(names) != sorted(AXES):
        raise ValueError(f"parallel_groups: order must name tp, dp and pp once each, fastest first "
                         f"(e.g. 'tp-dp-pp'), got {order!r}")
    return names


@dataclass
class ParallelGroups:
    """This rank's place in a tensor x pipeline x data-parallel job and its communicators (mpi4py).

    Attributes:
        world: the communicator split; ``rank``, ``size``: this rank in it and its size.
        tensor, pipeline, data: the group sizes (T, P, D = size / (T P)); ``order``: fastest axis first.
        tensor_rank, pipeline_rank, data_rank: this rank's coordinates (tp, pp, dp).
        tensor_comm: the T ranks that share this rank's (dp, pp); ranked by tp.
        pipeline_comm: the P stages of this rank's (dp, tp); ranked by pp.
        data_comm: the D replicas' ranks with this rank's (tp, pp); ranked by dp (gradient all-reduce).
        replica_comm: the T P ranks of this rank's model replica; ranked ``pp T + tp`` (leader first).
    """
    world: Any
    rank: int
    size: int
    tensor: int
    pipeline: int
    data: int
    order: tuple[str, ...]
    tensor_rank: int
    pipeline_rank: int
    data_rank: int
    tensor_comm: Any = None
    pipeline_comm: Any = None
    data_comm: Any = None
    replica_comm: Any = None

    __reduce_ex__ = errors.not_copyable("ParallelGroups (its communicators are this process's)",
                                        "call gm.parallel_groups(...) in each process")

    @property
    def is_leader(self) -> bool:
        """Whether this rank samples for its replica (``tp = 0, pp = 0``)."""
        return self.tensor_rank == 0 and self.pipeline_rank == 0

    @property
    def is_reporter(self) -> bool:
        """Whether this rank gives its replica's priority updates (``tp = 0``, last stage: where the loss is)."""
        return self.tensor_rank == 0 and self.pipeline_rank == self.pipeline - 1

    def world_rank(self, tp: int, pp: int, dp: int) -> int:
        """The world rank at coordinates (tp, pp, dp) in this job's order. Local, O(1).

        Raises:
            ValueError: a coordinate out of range.
        """
        coord, size = {"tp": tp, "pp": pp, "dp": dp}, {"tp": self.tensor, "pp": self.pipeline, "dp": self.data}
        rank, stride = 0, 1
        for a in self.order:
            if not 0 <= coord[a] < size[a]:
                raise ValueError(f"{a}={coord[a]} is out of range(0, {size[a]})")
            rank += coord[a] * stride
            stride *= size[a]
        return rank

    def replay_comm(self, sharding: str):
        """The ``comm`` to build this rank's Replay with, for a sharding (see the module docstring). Local.

        Args:
            sharding: ``"replica"`` (the leaders' data-parallel group; None on other ranks: they build no
                replay) or ``"world"`` (the world: every rank builds one).
        Raises:
            ValueError: another sharding.
        """
        if sharding == "world":
            return self.world
        if sharding == "replica":
            return self.data_comm if self.is_leader else None
        raise ValueError(f"sharding must be 'replica' or 'world', got {sharding!r}")

    def free(self) -> None:
        """Free the four communicators (local; idempotent)."""
        for name in ("tensor_comm", "pipeline_comm", "data_comm", "replica_comm"):
            c = getattr(self, name)
            if c is not None:
                try:
                    c.Free()
                except Exception:
                    pass
                setattr(self, name, None)


def parallel_groups(comm=None, tensor: int = 1, pipeline: int = 1, *, order: str = "tp-dp-pp",
                    timeout: float = 60.0) -> ParallelGroups:
    """Collective: split ``comm`` into tensor-, pipeline- and data-parallel communicators (module docstring).

    Args:
        comm: the world (an mpi4py communicator; None: ``MPI.COMM_WORLD``).
        tensor, pipeline: the group sizes T and P; the data-parallel size is ``comm.size / (T P)``.
        order: the axes fastest first (``"tp-dp-pp"``: Megatron's and DeepSpeed's default).
        timeout: seconds each step waits for every rank.
    Returns:
        The :class:`ParallelGroups` of this rank.
    Raises:
        ValueError: a size that is not a positive integer, ``comm.size`` not a multiple of ``T P``, a bad
            order, a ``timeout`` that is not a positive number, or ranks passing different arguments (the
            same error on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: one allgather of 4 float64 per rank, a barrier and four ``Split`` calls.
    """
    world, err = with_deadline(comm, timeout)
    T, P, names = 1, 1, AXES
    try:
        if err is not None:
            raise err
        T, P = _positive_int("tensor", tensor), _positive_int("pipeline", pipeline)
        names = _parse_order(order)
        if world.size % (T * P):
            raise ValueError(f"parallel_groups: the communicator has {world.size} ranks, not a multiple of "
                             f"tensor * pipeline = {T} * {P} = {T * P}; use a world of D * {T * P} ranks")
    except Exception as e:  # agreed below, so every rank raises it
        err = e
    table = world.agree(err, "parallel_groups", [T, P, AXES.index(names[0]), AXES.index(names[1])])
    if (table != table[0]).any():
        r = int(np.flatnonzero((table != table[0]).any(axis=1))[0])
        raise ValueError(f"parallel_groups: rank {r} passed other tensor/pipeline/order than rank 0")
    D = world.size // (T * P)
    size = {"tp": T, "dp": D, "pp": P}
    coord, rest = {}, world.rank
    for a in names:
        coord[a], rest = rest % size[a], rest // size[a]
    g = ParallelGroups(world.comm, world.rank, world.size, T, P, D, names, coord["tp"], coord["pp"], coord["dp"])
    world.barrier("parallel_groups (split)")  # Split blocks: every rank is known to be here first
    tp, pp, dp = coord["tp"], coord["pp"], coord["dp"]
    g.tensor_comm = world.comm.Split(color=dp * P + pp, key=tp)
    g.pipeline_comm = world.comm.Split(color=dp * T + tp, key=pp)
    g.data_comm = world.comm.Split(color=pp * T + tp, key=dp)
    g.replica_comm = world.comm.Split(color=dp, key=pp * T + tp)
    return g


def _sampler_comms(sampler) -> tuple:
    """A :class:`ReplicaSampler`'s communicators: its delivery group's and its replay's (None without one).
    An interrupt that leaves one of its calls may leave both out of step (between the replay's call and the
    delivery, between two broadcasts), so :func:`~gear_mpi.distributed.calls.interrupt_breaks` marks both."""
    replay = sampler.replay
    return sampler._group, None if replay is None else replay.calls.comm


class ReplicaSampler:
    """One batch per model replica, sampled by its leader and delivered to the ranks that need it.

    Construction is collective over the world (every rank, with the same ``stages`` and sharding).
    Args:
        replay: this rank's :class:`~gear_mpi.Replay` built with ``comm=groups.replay_comm(sharding)``;
            None on the ranks without one (non-leaders of the ``"replica"`` sharding).
        groups: from :func:`parallel_groups`.
        spec: the replay's TrajectorySpec; needed where ``replay`` is None (checked against the leader's).
        stages: ``"ends"`` (the first and last pipeline stages receive the batch) or ``"all"``.
        timeout: seconds a rank waits for its leader's batch (more than the replay's ``timeout`` plus,
            with a rate limiter, its ``rate_limit_timeout``: a leader's sample may be held that long).
    Attributes:
        sharding: ``"replica"`` or ``"world"`` (from the replay's communicator size).
        receives: whether this rank gets batches (its stage is one of ``stages``).
    Raises:
        ValueError: a bad argument (a ``timeout`` that is not a positive number included), no spec without a
            replay, groups already freed, or ranks that disagree (the same on every rank).
        TypeError: ``spec`` is not a TrajectorySpec (the same on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: one allgather of a 32-byte digest over the world, one barrier and one ``Split`` of the replica.
    """

    __reduce_ex__ = errors.not_copyable("a ReplicaSampler (its delivery group is an MPI communicator)",
                                        "build one in each process, on every rank")

    def __init__(self, replay, groups: ParallelGroups, *, spec=None, stages: str = "ends", timeout: float = 180.0):
        world, err = with_deadline(groups.world, timeout)
        sharding = "?"
        try:
            if err is not None:
                raise err
            if spec is not None and not isinstance(spec, TrajectorySpec):
                raise TypeError(f"spec must be a TrajectorySpec (the replay's), got {type(spec).__name__}")
            if groups.replica_comm is None:
                raise ValueError("the groups were freed (groups.free()): build the sampler before freeing them")
            if stages not in ("ends", "all"):
                raise ValueError(f"stages must be 'ends' or 'all', got {stages!r}")
            if replay is None:
                if spec is None:
                    raise ValueError("a rank without a replay must pass spec= (the replay's TrajectorySpec)")
                if groups.is_leader:
                    raise ValueError("a replica's leader (tp=0, pp=0) samples for it: it needs the replay")
                sharding = "replica"
            else:
                spec = replay.spec if spec is None else spec
                if replay.ranks == groups.size:
                    sharding = "world"
                elif replay.ranks == groups.data and groups.is_leader:
                    sharding = "replica"
                else:
                    raise ValueError(f"the replay has {replay.ranks} ranks: build it with "
                                     f"comm=groups.replay_comm('world') on every rank, or "
                                     f"comm=groups.replay_comm('replica') on the leaders only")
            if replay is not None and spec.to_dict() != replay.spec.to_dict():
                raise ValueError("spec= differs from the replay's spec")
        except Exception as e:  # agreed below
            err = e
        world.agree(err, "ReplicaSampler")
        world.agree_signature(repr((sharding, stages, spec.to_dict())), "ReplicaSampler",
                              "every rank must pass the same stages and spec, and build the replay alike")
        self.replay, self.groups, self.spec, self.sharding, self.stages = replay, groups, spec, sharding, stages
        self.receives = stages == "all" or groups.pipeline_rank in (0, groups.pipeline - 1)
        world.barrier("ReplicaSampler (split)")
        from mpi4py import MPI
        part = groups.replica_comm.Split(color=0 if self.receives else MPI.UNDEFINED,
                                         key=groups.pipeline_rank * groups.tensor + groups.tensor_rank)
        self._group = MpiComm(part, timeout) if self.receives else None
        self._reporter = None  # the reporter's rank in the delivery group (it receives with stages="ends")
        if self.receives:
            self._reporter = (groups.pipeline - 1) * groups.tensor if stages == "all" else \
                (groups.tensor if groups.pipeline > 1 else 0)
        self._closed = False

    def _check_open(self, what: str) -> None:
        """Raise if :meth:`close` was called (local, O(1)): a closed sampler would otherwise return None as a
        rank that receives nothing does.

        Raises:
            RuntimeError: the sampler is closed.
            CollectiveError: an earlier delivery on this rank timed out or was interrupted (the group is out of
                step).
        """
        if self._closed:
            raise RuntimeError(f"ReplicaSampler.{what}: this sampler is closed")
        if self._group is not None:  # a delivery that timed out or was interrupted: raise now, not at the deadline
            self._group.check_usable()

    # ---- sampling -------------------------------------------------------------------------------
    @interrupt_breaks("ReplicaSampler.sample", comms=_sampler_comms, started=None)
    def sample(self, batch_size: int, window: int | None = None, align: str = "random", *,
               mode: str | None = None) -> Batch | None:
        """Collective over the world: the leaders sample (``"world"``: every rank takes part, asking for 0),
        then each replica's delivery group receives its leader's batch (:meth:`deliver`).

        Args:
            batch_size: rows per replica (the leader's value counts; ignored elsewhere).
            window, align, mode: as :meth:`Replay.sample`, the same on every rank.
        Returns:
            The replica's batch on the ranks that receive one (the same rows on each of them; host memory
            on the peers), None on the others (middle pipeline stages with ``stages="ends"``).
        Raises:
            As :meth:`Replay.sample`: the leader's error is raised on each of its peers too.
            RuntimeError: the sampler is closed (on this rank).
        Cost: the replay's sample (the leaders' rows), then one broadcast of the batch in its replica:
            a 24-byte header and one Ibcast per column and per metadata array (``B W S`` bytes in all).
        """
        self._check_open("sample")
        batch, error = None, None
        if self.replay is not None:
            ask = batch_size if self.groups.is_leader else 0
            if self.sharding == "world":  # collective over the world: an error is raised on every rank alike
                batch = self.replay.sample(ask, window, align, mode=mode)
            else:
                try:
                    batch = self.replay.sample(ask, window, align, mode=mode)
                except Exception as e:  # told to the peers, then raised here too
                    error = e
        return self.deliver(batch if self.groups.is_leader else None, error)

    @interrupt_breaks("ReplicaSampler.deliver", comms=_sampler_comms, started=None)
    def deliver(self, batch: Batch | None = None, error: BaseException | None = None) -> Batch | None:
        """Collective over the replica's delivery group: its leader's ``batch`` (or ``error``) to every member.

        Call it on every rank of the world (ranks that do not receive return None at once); e.g. with a
        leader's batch from ``replay.batches(...)``. The other ranks' arguments are ignored.
        Args:
            batch: the leader's batch (host or device; a device batch is copied to the host to be sent), of the
                sampler's spec.
            error: the leader's exception instead of a batch: raised on every member.
        Returns:
            The leader's own ``batch`` on the leader; a host :class:`Batch` with the same rows elsewhere.
        Raises:
            The leader's ``error`` (its class, or the nearest gear_mpi/builtin base, with its message).
            TypeError, ValueError: the leader's ``batch`` is no Batch, or not one of the sampler's spec;
                ``error`` is no exception (on every member, as the leader's error).
            RuntimeError: the sampler is closed (on this rank).
            CollectiveTimeoutError: the leader did not deliver within ``timeout``.
        """
        self._check_open("deliver")
        g = self._group
        if g is None:
            return None
        leader = g.rank == 0
        head = np.zeros(3, np.int64)
        if leader:
            if error is None:
                error = _batch_problem(batch, self.spec)  # refused before any byte is sent: every member raises it
            elif not isinstance(error, BaseException):
                error = TypeError(f"deliver: error must be an exception, got {type(error).__name__}")
            if error is not None:
                head[0] = _error_code(error)
            else:
                head[1:] = (batch.batch_size, batch.window)
        head = g.bcast(head, 0, "ReplicaSampler.deliver (header)")
        if head[0]:
            raise _share_error(g, 0, error, int(head[0]), "ReplicaSampler.deliver (error)", "leader")
        if not leader:
            batch = Batch.empty(self.spec, int(head[1]), int(head[2]))
        arrays = _host_arrays(batch)  # the members': their new batch's own buffers, received into
        g.wait_all([g.comm.Ibcast(a.reshape(-1).view(np.uint8), 0) for a in arrays],
                   "ReplicaSampler.deliver (batch)")
        return batch

    # ---- priorities -----------------------------------------------------------------------------
    @interrupt_breaks("ReplicaSampler.update_priorities", comms=_sampler_comms, started=None)
    def update_priorities(self, keys: Any = (), priorities: Any = (), *, iterator=None) -> int:
        """Collective over the world: the replica's reporter (``tp = 0``, last stage) gives new priorities for
        keys of its batch; the other ranks' arguments are ignored.

        ``"world"``: one ``replay.update_priorities`` over the world (the others give none).
        ``"replica"``: the reporter's keys reach its leader (a broadcast in the delivery group when the
        reporter is not the leader), then the leaders call ``replay.update_priorities``.
        The reporter checks its keys (integers: a float key would lose its low bits) and priorities first, as
        the replay would; a refused update is applied nowhere and raised where the replay's errors are (every
        rank of the replay's communicator) and on the reporter's delivery group, instead of the others waiting
        for the reporter until ``timeout``.
        Args:
            keys, priorities: as :meth:`Replay.update_priorities` (e.g. ``batch.keys`` and new |TD errors|).
            iterator: the ``replay.batches()`` iterator that owns this rank's replay, if any: the update is
                then given to it (applied before a later sample, as its docs say). A refused update gives it
                none (the iterators stay in step) and is raised on the reporter's replica only.
        Returns:
            What ``replay.update_priorities`` returned on this rank (0 on ranks without a replay, and when
            given to an iterator).
        Raises:
            As :meth:`Replay.update_priorities` (every rank of the replay's communicator).
            TypeError, InvalidPriorityError: the reporter's keys are not integers, or its priorities not one
                finite non-negative number per key (also on the reporter's delivery group).
            RuntimeError: the sampler is closed (on this rank).
        """
        self._check_open("update_priorities")
        g, mine = self.groups, self.groups.is_reporter
        k, p, problem = np.zeros(0, np.int64), np.zeros(0), None
        if mine:
            try:
                k = np.ascontiguousarray(as_key_array(keys))  # TypeError for non-integers
                p = validate_priorities(priorities, len(k))
            except Exception as e:  # refused: applied nowhere, raised below
                k, problem = np.zeros(0, np.int64), e
        if self.sharding == "replica" and self._group is not None and g.pipeline > 1:
            k, p, problem = self._from_reporter(k, p, problem, mine)
        if self.sharding == "replica" and not g.is_leader:  # no replay here
            if problem is not None:
                raise problem
            return 0
        if iterator is not None:  # deferred by the iterator (an empty update when refused: the threads stay in step)
            iterator.update_priorities(k, p)
            if problem is not None:
                raise problem
            return 0
        # a refused update's error goes into the replay's own agreement: every rank raises it
        return self.replay._update(k, p, problem=problem)

    def _from_reporter(self, k: np.ndarray, p: np.ndarray, problem: BaseException | None,
                       mine: bool) -> tuple[np.ndarray, np.ndarray, BaseException | None]:
        """Collective over the delivery group: the reporter's checked keys and priorities, or its refusal, to
        every member. Returns ``(keys, priorities, refusal or None)`` (none of either when refused).
        Cost: a 24-byte broadcast, then two Ibcasts of 8 bytes per key (or one of :data:`_MESSAGE` bytes)."""
        grp, root = self._group, self._reporter
        head = grp.bcast(np.array([len(k), len(p), _error_code(problem)], np.int64), root,
                         "update_priorities (count)")
        if head[2]:
            problem = _share_error(grp, root, problem, int(head[2]), "update_priorities (refused)", "reporter")
            return np.zeros(0, np.int64), np.zeros(0), problem
        if not mine:
            k, p = np.zeros(int(head[0]), np.int64), np.zeros(int(head[1]))
        grp.wait_all([grp.comm.Ibcast(k, root), grp.comm.Ibcast(p, root)], "update_priorities (keys)")
        return k, p, None

    def close(self) -> None:
        """Free the delivery group (local; idempotent): later calls raise RuntimeError. The replay and the groups
        stay the caller's."""
        self._closed = True
        if self._group is not None:
            self._group.free()
            self._group = None


def _error_code(error: BaseException | None) -> int:
    """0 for None, else 1 + the index in :data:`_DELIVERED` of the most specific class ``error`` is (0: an exception
    of no class there, sent as Exception). Local, O(classes)."""
    return 0 if error is None else 1 + error_code(error, _DELIVERED)


def _share_error(group: MpiComm, root: int, error: BaseException | None, code: int, what: str,
                 who: str) -> BaseException:
    """Collective over ``group``: ``root``'s ``error`` (of :func:`_error_code` ``code``) to every member. Returns
    the exception to raise: ``error`` itself on ``root``, elsewhere the same class (or its nearest base in
    :data:`_DELIVERED`) with its message and ``"(raised by this replica's <who>)"``. Cost: one broadcast of
    :data:`_MESSAGE` bytes."""
    msg = group.bcast(message_bytes(error if group.rank == root else None, _MESSAGE), root, what)
    if group.rank == root:
        return error
    return _DELIVERED[code - 1](f"{message_text(msg)} (raised by this replica's {who})")


def _batch_problem(batch: Any, spec: TrajectorySpec) -> Exception | None:
    """Why the leader's ``batch`` cannot be delivered as a batch of ``spec`` (its members receive into
    ``Batch.empty(spec, B, W)``), or None. Local, O(columns).

    Args:
        batch: what the leader passed; spec: the sampler's spec.
    Returns:
        A TypeError (no Batch), a ValueError (other columns, dtypes or sizes), or None.
    """
    if batch is None:
        return ValueError("deliver: the leader has no batch to deliver")
    if not isinstance(batch, Batch):
        return TypeError(f"deliver: the leader's batch must be a gear_mpi Batch, got {type(batch).__name__}")
    if tuple(batch.columns) != tuple(spec.batch_names):
        return ValueError(f"deliver: the leader's batch has the columns {list(batch.columns)}, the sampler's spec "
                          f"{list(spec.batch_names)}: deliver batches of the replay the sampler was built for")
    b, w = batch.batch_size, batch.window
    columns = batch._names()  # a host batch's buffers (no tensor made, torch not imported), a device batch's tensors
    for c in spec.batch_columns:
        t = columns[c.name]
        size, itemsize = (t.size, t.itemsize) if isinstance(t, np.ndarray) else (t.numel(), t.element_size())
        if size != b * w * int(np.prod(c.shape)) or itemsize != np.dtype(c.dtype).itemsize:
            return ValueError(f"deliver: the leader's column {c.name!r} is {tuple(t.shape)} {t.dtype}, not {b} "
                              f"windows of {w} steps of {c.shape} {np.dtype(c.dtype)} as the sampler's spec says")
    return None


def _host_arrays(batch: Batch) -> list[np.ndarray]:
    """The batch's columns, mask, keys, probabilities, weights, lengths as contiguous host arrays (no copy
    for a host batch, whose buffers are read without making its tensors)."""
    try:
        return [*batch.numpy().values(), batch.mask_numpy(), *batch.meta_numpy()]
    except RuntimeError:  # a device batch
        pass
    tensors = itertools.chain(batch.data.values(), (batch.mask, batch.keys, batch.probabilities, batch.weights,
                                                    batch.lengths))
    return [np.ascontiguousarray(t.detach().cpu().numpy()) for t in tensors]

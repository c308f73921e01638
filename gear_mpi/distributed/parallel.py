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
from .comm import MpiComm

AXES = ("tp", "dp", "pp")
#: errors a leader's failed sample is re-raised as on its peers (the most specific class that fits)
_DELIVERED = (Exception, ValueError, TypeError, KeyError, RuntimeError, TimeoutError, errors.GearError,
              errors.InvalidTrajectoryError, errors.InvalidPriorityError, errors.InvalidKeyError,
              errors.StaleKeyError, errors.EmptyReplayError, errors.CollectiveError,
              errors.CollectiveTimeoutError, errors.RateLimitTimeoutError)
_MESSAGE = 1024


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
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
            order, or ranks passing different arguments (the same error on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: one allgather of 4 float64 per rank, a barrier and four ``Split`` calls.
    """
    world = MpiComm(comm, timeout)
    err, T, P, names = None, 1, 1, AXES
    try:
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
        ValueError: a bad argument, no spec without a replay, or ranks that disagree (the same on every rank).
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: one allgather of a 32-byte digest over the world, one barrier and one ``Split`` of the replica.
    """

    def __init__(self, replay, groups: ParallelGroups, *, spec=None, stages: str = "ends", timeout: float = 180.0):
        world = MpiComm(groups.world, timeout)
        err, sharding = None, "?"
        try:
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

    # ---- sampling -------------------------------------------------------------------------------
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
        Cost: the replay's sample (the leaders' rows), then one broadcast of the batch in its replica:
            a 24-byte header and one Ibcast per column and per metadata array (``B W S`` bytes in all).
        """
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

    def deliver(self, batch: Batch | None = None, error: BaseException | None = None) -> Batch | None:
        """Collective over the replica's delivery group: its leader's ``batch`` (or ``error``) to every member.

        Call it on every rank of the world (ranks that do not receive return None at once); e.g. with a
        leader's batch from ``replay.batches(...)``. The other ranks' arguments are ignored.
        Args:
            batch: the leader's batch (host or device; a device batch is copied to the host to be sent).
            error: the leader's exception instead of a batch: raised on every member.
        Returns:
            The leader's own ``batch`` on the leader; a host :class:`Batch` with the same rows elsewhere.
        Raises:
            The leader's ``error`` (its class, or the nearest gear_mpi/builtin base, with its message).
            CollectiveTimeoutError: the leader did not deliver within ``timeout``.
        """
        g = self._group
        if g is None:
            return None
        leader = g.rank == 0
        head = np.zeros(3, np.int64)
        if leader:
            if error is None and batch is None:
                error = ValueError("deliver: the leader has no batch to deliver")
            if error is not None:
                head[0] = 1 + max(i for i, c in enumerate(_DELIVERED) if isinstance(error, c))
            else:
                head[1:] = (batch.batch_size, batch.window)
        head = g.bcast(head, 0, "ReplicaSampler.deliver (header)")
        if head[0]:
            msg = np.zeros(_MESSAGE, np.uint8)
            if leader:
                text = str(error).encode("utf-8", "replace")[:_MESSAGE]
                msg[:len(text)] = np.frombuffer(text, np.uint8)
            msg = g.bcast(msg, 0, "ReplicaSampler.deliver (error)")
            if leader:
                raise error
            text = bytes(msg).rstrip(b"\0").decode("utf-8", "replace")
            raise _DELIVERED[int(head[0]) - 1](f"{text} (raised by this replica's leader)")
        if leader:
            arrays = _host_arrays(batch)
        else:
            batch = Batch.empty(self.spec, int(head[1]), int(head[2]))
            arrays = [*batch.numpy().values(), batch.mask.numpy(), *batch.meta_numpy()]
        g.wait_all([g.comm.Ibcast(a.reshape(-1).view(np.uint8), 0) for a in arrays],
                   "ReplicaSampler.deliver (batch)")
        return batch

    # ---- priorities -----------------------------------------------------------------------------
    def update_priorities(self, keys: Any = (), priorities: Any = (), *, iterator=None) -> int:
        """Collective over the world: the replica's reporter (``tp = 0``, last stage) gives new priorities for
        keys of its batch; the other ranks' arguments are ignored.

        ``"world"``: one ``replay.update_priorities`` over the world (the others give none).
        ``"replica"``: the reporter's keys reach its leader (a broadcast in the delivery group when the
        reporter is not the leader), then the leaders call ``replay.update_priorities``.
        Args:
            keys, priorities: as :meth:`Replay.update_priorities` (e.g. ``batch.keys`` and new |TD errors|).
            iterator: the ``replay.batches()`` iterator that owns this rank's replay, if any: the update is
                then given to it (applied before a later sample, as its docs say).
        Returns:
            What ``replay.update_priorities`` returned on this rank (0 on ranks without a replay, and when
            given to an iterator).
        Raises:
            As :meth:`Replay.update_priorities` (every rank of the replay's communicator).
        """
        g, mine = self.groups, self.groups.is_reporter
        k, p = np.zeros(0, np.int64), np.zeros(0)
        if mine:
            k = np.ascontiguousarray(keys.cpu().numpy() if hasattr(keys, "cpu") else keys, np.int64).reshape(-1)
            p = np.ascontiguousarray(priorities.detach().cpu().numpy() if hasattr(priorities, "detach")
                                     else priorities, np.float64).reshape(-1)
        def apply(k, p) -> int:
            if iterator is not None:  # deferred by the iterator
                iterator.update_priorities(k, p)
                return 0
            return self.replay.update_priorities(k, p)
        if self.sharding == "world":
            return apply(k, p)
        if self._group is not None and g.pipeline > 1:  # the reporter's keys to the leader
            n = self._group.bcast(np.array([len(k), len(p)], np.int64), self._reporter, "update_priorities (count)")
            if not mine:
                k, p = np.zeros(int(n[0]), np.int64), np.zeros(int(n[1]))
            self._group.wait_all([self._group.comm.Ibcast(k, self._reporter),
                                  self._group.comm.Ibcast(p, self._reporter)], "update_priorities (keys)")
        return apply(k, p) if g.is_leader else 0

    def close(self) -> None:
        """Free the delivery group (local; idempotent). The replay and the groups stay the caller's."""
        if self._group is not None:
            self._group.free()
            self._group = None


def _host_arrays(batch: Batch) -> list[np.ndarray]:
    """The batch's columns, mask, keys, probabilities, weights, lengths as contiguous host arrays (no copy
    for a host batch)."""
    tensors = itertools.chain(batch.data.values(), (batch.mask, batch.keys, batch.probabilities, batch.weights,
                                                    batch.lengths))
    return [np.ascontiguousarray(t.detach().cpu().numpy()) for t in tensors]

"""Model-parallel groups taken from what a training job already built: a torch ``DeviceMesh``, Megatron-core's
``parallel_state``, a DeepSpeed ``mpu``, or any three torch.distributed process groups.

A job that trains with one of those frameworks already has its tensor-, pipeline- and data-parallel process
groups; :func:`parallel_groups` would rebuild them from sizes and an order the user must restate. These
functions read the framework's groups instead and return the same :class:`ParallelGroups` that
:func:`parallel_groups` builds for that layout (MPI communicators with the same members in the same rank
order), so that :class:`ReplicaSampler` and ``replay_comm`` work unchanged.

How ranks are mapped: every rank of ``comm`` tells its torch.distributed global rank (one MPI allgather),
which maps each torch rank to an MPI rank of ``comm``. With :func:`gear_mpi.init_torch_process_group` (or
``torchrun`` under ``mpiexec`` with ``RANK`` set to the MPI rank) the two are equal; they need not be, but
the torch ranks must be distinct and every member of the groups must be a rank of ``comm``. The groups are
then read as a T x P x D grid of ``comm``'s ranks (``tp``, ``pp``, ``dp``: this rank's index in each group)
and matched against the six orders of the three axes; the first that puts every rank where it is
(``tp-dp-pp`` -- Megatron's and DeepSpeed's default -- first, then ``tp-pp-dp``, ...) is taken, every
rank checks that each of its torch groups holds exactly the ranks that order gives it, and
:func:`parallel_groups` builds the communicators. A layout that is no such grid (context or expert
parallelism folded in, a hand-made mesh in no rank order) is refused with an error on every rank.

Torch is imported only when one of these functions is called.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .comm import with_deadline
from .parallel import AXES, ParallelGroups, parallel_groups

#: the orders tried, fastest axis first; the first that fits the groups is taken (Megatron's default first)
ORDERS = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp")
#: an mpu's accessors for each axis, in the order they are looked for: Megatron-core's names, DeepSpeed's
#: pipeline grid's (``slice`` is its tensor axis, ``pipe`` its pipeline), then the legacy Megatron spelling
#: ("model parallel" meaning tensor parallel, before pipelines)
MPU_GROUPS = {
    "tp": ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"),
    "pp": ("get_pipeline_model_parallel_group", "get_pipe_parallel_group"),
    "dp": ("get_data_parallel_group",),
}


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised on this rank: start it first (e.g. "
                         "gm.init_torch_process_group(comm) or torch.distributed.init_process_group), then build "
                         "the framework's groups")
    return dist


def _members(dist, group, axis: str, me: int) -> list[int]:
    """The torch global ranks of ``group`` in its rank order (``[me]`` for None: an axis of size 1)."""
    if group is None:
        return [me]
    try:
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception as e:  # noqa: BLE001 -- torch raises several kinds for a foreign object
        raise ValueError(f"the {axis} group is not a torch.distributed process group this rank belongs to "
                         f"({type(group).__name__}: {e})") from None
    if me not in ranks:
        raise ValueError(f"this rank (torch rank {me}) is not a member of its own {axis} group {ranks}")
    return ranks


def from_process_groups(tensor=None, pipeline=None, data=None, comm=None, *,
                        timeout: float = 60.0) -> ParallelGroups:
    """Collective over ``comm``: the :class:`ParallelGroups` whose communicators have the members of three torch
    process groups (module docstring).

    Args:
        tensor, pipeline, data: this rank's torch.distributed process groups of each axis (None: that axis has
            size 1); their members are torch global ranks, in the group's rank order.
        comm: the mpi4py communicator over the same processes (None: ``MPI.COMM_WORLD``).
        timeout: seconds each step waits for every rank.
    Returns:
        What ``parallel_groups(comm, T, P, order=...)`` returns for the layout the groups form.
    Raises:
        ValueError: on every rank: a ``timeout`` that is not a positive number, torch.distributed not
            initialised, an object that is not a process group of this rank, two ranks of ``comm`` with one torch rank, a group member outside ``comm``, groups of
            different sizes on different ranks, ``T P D`` other than ``comm.size``, groups that form no grid
            in any order of ``comm``'s ranks, or a group whose members differ from what that order gives.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: two MPI allgathers (7 float64 a rank, then 1), the torch groups' member lists read locally
        (O(T + P + D)), then :func:`parallel_groups` (an allgather, a barrier and four ``Split`` calls).
    """
    return _adopt(lambda: {"tp": tensor, "pp": pipeline, "dp": data}, comm, timeout,
                  "parallel_groups.from_process_groups")


def _adopt(read_groups: Callable[[], dict[str, Any]], comm, timeout: float, what: str) -> ParallelGroups:
    """The collective behind every ``from_*``: ``read_groups()`` (axis -> torch group or None) on every rank,
    its failure agreed; the layout inferred and checked; :func:`parallel_groups` for it."""
    world, err = with_deadline(comm, timeout)  # a bad timeout: agreed below, under the default deadline
    values, members = [0] * 7, {}
    try:
        if err is not None:
            raise err
        dist = _dist()  # first: the framework's accessors fail less clearly without it
        groups = read_groups()
        me = int(dist.get_rank())
        members = {a: _members(dist, groups.get(a), a, me) for a in AXES}
        size = {a: len(members[a]) for a in AXES}
        index = {a: members[a].index(me) for a in AXES}
        values = [me, size["tp"], size["pp"], size["dp"], index["tp"], index["pp"], index["dp"]]
    except Exception as e:  # noqa: BLE001 -- agreed below, so every rank raises it
        err = e
    table = world.agree(err, what, values).astype(np.int64)
    T, P, D, order, mpi_of = _layout(table, world.size, what)  # the same table on every rank: the same verdict
    err = None
    try:
        _check_members(members, mpi_of, order, (T, P, D), table[world.rank, 4:7])
    except Exception as e:  # noqa: BLE001 -- agreed below
        err = e
    world.agree(err, what)
    return parallel_groups(world.comm, T, P, order=order, timeout=timeout)


def _layout(table: np.ndarray, size: int, what: str) -> tuple[int, int, int, str, dict[int, int]]:
    """From each rank's ``[torch rank, T, P, D, tp, pp, dp]`` (row r: MPI rank r): the sizes, the first order
    of :data:`ORDERS` whose rank formula gives every row its own MPI rank, and torch rank -> MPI rank. Local,
    O(size), the same on every rank.

    Raises:
        ValueError: duplicate torch ranks, sizes that differ between ranks or whose product is not ``size``,
            or no order that fits.
    """
    torch_ranks = table[:, 0]
    mpi_of = {int(t): r for r, t in enumerate(torch_ranks)}
    if len(mpi_of) != size:
        t = int(next(t for t in torch_ranks if (torch_ranks == t).sum() > 1))
        both = np.flatnonzero(torch_ranks == t).tolist()
        raise ValueError(f"{what}: ranks {both} of the MPI communicator are all torch rank {t}: the communicator "
                         f"and torch.distributed do not span the same processes (start torch.distributed over "
                         f"this communicator, e.g. gm.init_torch_process_group(comm))")
    sizes = table[:, 1:4]
    if (sizes != sizes[0]).any():
        r = int(np.flatnonzero((sizes != sizes[0]).any(axis=1))[0])
        raise ValueError(f"{what}: rank {r}'s groups have tensor/pipeline/data sizes {sizes[r].tolist()}, "
                         f"rank 0's {sizes[0].tolist()}: the groups must split every rank alike")
    T, P, D = (int(x) for x in sizes[0])
    if T * P * D != size:
        raise ValueError(f"{what}: tensor x pipeline x data = {T} x {P} x {D} = {T * P * D} ranks, but the MPI "
                         f"communicator has {size}: the groups must cover it exactly (context or expert "
                         f"parallelism folded into other groups is not supported)")
    extent = {"tp": T, "pp": P, "dp": D}
    coord = {"tp": table[:, 4], "pp": table[:, 5], "dp": table[:, 6]}
    for order in ORDERS:
        rank, stride = np.zeros(size, np.int64), 1
        for a in order.split("-"):
            rank += coord[a] * stride
            stride *= extent[a]
        if np.array_equal(rank, np.arange(size)):
            return T, P, D, order, mpi_of
    rows = ", ".join(f"{r}: torch {int(t)} (tp={int(c[0])}, pp={int(c[1])}, dp={int(c[2])})"
                     for r, (t, c) in enumerate(zip(torch_ranks, table[:, 4:7])) if r < 8)
    raise ValueError(f"{what}: the groups form no {T} x {P} x {D} grid of the MPI ranks in any order of tp, dp "
                     f"and pp (MPI rank: {rows}{', ...' if size > 8 else ''}); if torch ranks and MPI ranks "
                     f"differ, pass comm=comm.Split(0, key=torch.distributed.get_rank())")


def _check_members(members: dict[str, list[int]], mpi_of: dict[int, int], order: str, sizes: Sequence[int],
                   coords: np.ndarray) -> None:
    """Each of this rank's torch groups, mapped to MPI ranks, holds exactly the ranks ``order`` puts on its axis,
    in the same rank order. Local, O(T + P + D).

    Raises:
        ValueError: a member outside the communicator, or members other than the layout's.
    """
    extent = dict(zip(("tp", "pp", "dp"), (int(s) for s in sizes)))
    mine = dict(zip(("tp", "pp", "dp"), (int(c) for c in coords)))
    names = order.split("-")

    def rank_at(c: dict[str, int]) -> int:
        r, stride = 0, 1
        for a in names:
            r, stride = r + c[a] * stride, stride * extent[a]
        return r

    for axis in AXES:
        outside = [t for t in members[axis] if t not in mpi_of]
        if outside:
            raise ValueError(f"torch ranks {outside} of this rank's {axis} group are no rank of the MPI communicator")
        got = [mpi_of[t] for t in members[axis]]
        want = [rank_at({**mine, axis: i}) for i in range(extent[axis])]
        if got != want:
            raise ValueError(f"this rank's {axis} group holds MPI ranks {got}, but the layout {order} the other "
                             f"groups form gives it {want}: the groups are not one tensor x pipeline x data grid")


def from_device_mesh(mesh, comm=None, *, tensor: str = "tp", pipeline: str = "pp", data: str = "dp",
                     timeout: float = 60.0) -> ParallelGroups:
    """Collective over ``comm``: the :class:`ParallelGroups` of a torch ``DeviceMesh`` with named dimensions.

    ``init_device_mesh("cuda", (D, T), mesh_dim_names=("dp", "tp"))`` gives the groups of
    ``parallel_groups(comm, tensor=T)``; a dimension the mesh lacks has size 1. The mesh's process
    groups are read (``mesh.get_group(name)``) and mapped to MPI ranks as the module docstring says.

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` holding this rank, built with ``mesh_dim_names``.
        comm: the mpi4py communicator over the mesh's processes (None: ``MPI.COMM_WORLD``).
        tensor, pipeline, data: the mesh dimension names of each axis (a name the mesh lacks: size 1). Every
            dimension of the mesh larger than 1 must be one of them (flatten several into one first, e.g.
            ``mesh["dp_replicate", "dp_shard"]._flatten("dp")``, and name that).
        timeout: seconds each step waits for every rank.
    Returns:
        The same groups as :func:`parallel_groups` builds for the mesh's layout.
    Raises:
        ValueError: on every rank: not a mesh with dimension names, a name given for two axes, a mesh
            dimension of size > 1 that is no axis, or any error of :func:`from_process_groups`.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: as :func:`from_process_groups`.
    """
    return _adopt(lambda: _mesh_groups(mesh, {"tp": tensor, "pp": pipeline, "dp": data}), comm, timeout,
                  "parallel_groups.from_device_mesh")


def _mesh_groups(mesh, names: dict[str, str]) -> dict[str, Any]:
    """Axis -> the mesh's process group for it (absent: size 1). Local."""
    dims = getattr(mesh, "mesh_dim_names", None)
    if not hasattr(mesh, "get_group") or not dims:
        raise ValueError(f"expected a torch DeviceMesh built with mesh_dim_names=(...), got {type(mesh).__name__}"
                         + ("" if not hasattr(mesh, "get_group") else " without dimension names"))
    for axis, name in names.items():
        if not isinstance(name, str):
            raise ValueError(f"the mesh dimension of {axis} must be a name (str), got {name!r}")
    if len(set(names.values())) != 3:
        raise ValueError(f"tensor={names['tp']!r}, pipeline={names['pp']!r}, data={names['dp']!r}: each axis "
                         f"needs its own mesh dimension")
    dims = tuple(dims)
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank is not in the mesh {mesh}")
    axis_of = {name: axis for axis, name in names.items()}
    groups = {}
    for i, dim in enumerate(dims):
        n = int(mesh.size(i))
        if dim in axis_of:
            groups[axis_of[dim]] = mesh.get_group(dim)
        elif n > 1:
            raise ValueError(f"mesh dimension {dim!r} (size {n}) is none of tensor={names['tp']!r}, "
                             f"pipeline={names['pp']!r}, data={names['dp']!r}: name it as one of them, or flatten "
                             f"it with another dimension into one")
    return groups


def from_mpu(mpu, comm=None, *, timeout: float = 60.0) -> ParallelGroups:
    """Collective over ``comm``: the :class:`ParallelGroups` of a Megatron/DeepSpeed model-parallel unit (``mpu``).

    ``mpu`` is any object with the groups' accessors (module docstring, :data:`MPU_GROUPS`):
    ``megatron.core.parallel_state`` itself after ``initialize_model_parallel(...)``, DeepSpeed's
    ``PipelineParallelGrid`` (``get_slice_parallel_group`` for tensor, ``get_pipe_parallel_group``),
    or the ``mpu`` a job passes to ``deepspeed.initialize``. Tensor parallelism is read from
    ``get_tensor_model_parallel_group``, else ``get_slice_parallel_group``, else the legacy
    ``get_model_parallel_group``; pipeline from ``get_pipeline_model_parallel_group``, else
    ``get_pipe_parallel_group`` (neither: one stage); data from ``get_data_parallel_group`` (required).

    Args:
        mpu: the model-parallel unit.
        comm: the mpi4py communicator over the job's processes (None: ``MPI.COMM_WORLD``).
        timeout: seconds each step waits for every rank.
    Returns:
        The same groups as :func:`parallel_groups` builds for the mpu's layout.
    Raises:
        ValueError: on every rank: no data-parallel group accessor, an accessor that fails, context
            parallelism (``get_context_parallel_world_size() > 1``), or any error of
            :func:`from_process_groups`.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: as :func:`from_process_groups`.
    """
    return _adopt(lambda: _mpu_groups(mpu), comm, timeout, "parallel_groups.from_mpu")


def _mpu_groups(mpu) -> dict[str, Any]:
    """Axis -> the mpu's process group for it (no accessor: size 1, except data: required). Local."""
    cp = getattr(mpu, "get_context_parallel_world_size", None)
    if callable(cp):
        try:
            n = int(cp())
        except Exception:  # noqa: BLE001 -- an mpu without context parallelism set up
            n = 1
        if n > 1:
            raise ValueError(f"the mpu has context parallelism of {n}: its data-parallel group then leaves the "
                             f"context-parallel ranks out, which no tensor x pipeline x data grid describes")
    groups = {}
    for axis, accessors in MPU_GROUPS.items():
        found = next((name for name in accessors if callable(getattr(mpu, name, None))), None)
        if found is None:
            if axis == "dp":
                raise ValueError(f"{type(mpu).__name__} has no get_data_parallel_group(): expected a Megatron or "
                                 f"DeepSpeed mpu (e.g. megatron.core.parallel_state after initialize_model_parallel)")
            continue
        try:
            groups[axis] = getattr(mpu, found)()
        except Exception as e:  # noqa: BLE001 -- Megatron asserts when its groups are not initialised
            raise ValueError(f"mpu.{found}() failed (are the model-parallel groups initialised?): "
                             f"{type(e).__name__}: {e}") from None
    return groups

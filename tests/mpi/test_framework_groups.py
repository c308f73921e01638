"""Model-parallel groups taken from a torch DeviceMesh, Megatron-core's parallel_state, a DeepSpeed-style mpu or
three torch process groups (gm.parallel_groups.from_device_mesh / from_mpu / from_process_groups), on 4 ranks
with torch.distributed over gloo started by gm.init_torch_process_group.

- Each layout gives exactly what gm.parallel_groups builds for it: the same sizes, order, coordinates, roles
  (leader, reporter) and the same members in the same rank order in each of the four communicators; a sum
  over each torch group equals the sum over the matching MPI communicator.
- Meshes (dp, tp), (pp, dp), (dp, pp), (pp, dp, tp), (dp,) and custom dimension names; Megatron-core's own
  parallel_state after initialize_model_parallel (tp 2, pp 2, both, and its tp-pp-dp order; skipped without
  megatron-core); a DeepSpeed PipelineParallelGrid-like mpu whose get_model_parallel_group is tensor x pipeline
  (its slice group is the tensor axis).
- The adopted groups drive a ReplicaSampler: the tensor peers of a replica receive the same rows.
- Bad input raises the same ValueError on every rank: torch.distributed not started, not a mesh, a mesh
  dimension that is no axis, an mpu without a data-parallel group, groups that cover another number of ranks
  than the communicator, groups that form no grid, MPI ranks that are not in the torch ranks' order (and the
  Split by torch rank the error suggests then works).

Run by tests/test_parallel_mpi.py (``mpiexec -n 4 python -m pytest tests/mpi/test_framework_groups.py``); on
another number of ranks the tests skip.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, SPEC, TIMEOUT, insert_random

pytestmark = pytest.mark.skipif(SIZE != 4, reason="the layouts tested need 4 ranks")
FIELDS = ("rank", "size", "tensor", "pipeline", "data", "order", "tensor_rank", "pipeline_rank", "data_rank",
          "is_leader", "is_reporter")
COMMS = ("tensor_comm", "pipeline_comm", "data_comm", "replica_comm")


def test_torch_not_started_fails_on_every_rank():
    """Runs first, before the fixture below starts torch.distributed."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    expect = "torch.distributed is not initialised"
    for call in (lambda: gm.parallel_groups.from_process_groups(comm=COMM, timeout=TIMEOUT),
                 lambda: gm.parallel_groups.from_mpu(_GridMpu({}), COMM, timeout=TIMEOUT)):
        _same_error(call, expect)


@pytest.fixture(scope="module")
def dist():
    import torch.distributed as dist
    gm.init_torch_process_group(COMM, "gloo", timeout=TIMEOUT)
    assert dist.get_rank() == RANK and dist.get_world_size() == SIZE
    yield dist
    dist.destroy_process_group()


def _same_error(call, expect: str) -> None:
    try:
        call()
    except ValueError as e:
        msgs = COMM.allgather(str(e))
        assert len(set(msgs)) == 1, msgs
        assert expect in msgs[0], (expect, msgs[0])
        return
    raise AssertionError(f"no ValueError on rank {RANK}")


def members(comm) -> list[int]:
    """The world ranks of ``comm`` in its rank order."""
    return comm.allgather(RANK)


def assert_same_groups(got: gm.ParallelGroups, want: gm.ParallelGroups) -> None:
    """The same layout, roles and communicators (members in the same rank order)."""
    for f in FIELDS:
        assert getattr(got, f) == getattr(want, f), (f, getattr(got, f), getattr(want, f))
    for name in COMMS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a.size, a.rank) == (b.size, b.rank), name
        assert members(a) == members(b), name
    assert got.world_rank(got.tensor_rank, got.pipeline_rank, got.data_rank) == RANK


def assert_torch_groups_match(dist, got: gm.ParallelGroups, torch_groups: dict) -> None:
    """A sum over each torch group equals the sum over the MPI communicator adopted from it."""
    import torch
    from mpi4py import MPI
    for axis, comm in (("tp", got.tensor_comm), ("pp", got.pipeline_comm), ("dp", got.data_comm)):
        group = torch_groups.get(axis)
        if group is None:
            assert comm.size == 1
            continue
        t = torch.tensor([10.0 ** RANK])
        dist.all_reduce(t, group=group)
        assert t.item() == comm.allreduce(10.0 ** RANK, op=MPI.SUM), axis


def check_against_parallel_groups(got: gm.ParallelGroups, tensor: int, pipeline: int, order: str) -> None:
    want = gm.parallel_groups(COMM, tensor, pipeline, order=order, timeout=TIMEOUT)
    try:
        assert_same_groups(got, want)
    finally:
        want.free()
        got.free()


# ---- DeviceMesh ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,names,tensor,pipeline,order", [
    # (kept to three layouts for CI time: tensor only, pipeline outermost of three axes, data outside pipeline)
    ((2, 2), ("dp", "tp"), 2, 1, "tp-dp-pp"),
    ((2, 2), ("dp", "pp"), 1, 2, "tp-pp-dp"),
    ((2, 1, 2), ("pp", "dp", "tp"), 2, 2, "tp-dp-pp"),
])
def test_device_mesh_gives_what_parallel_groups_builds(dist, shape, names, tensor, pipeline, order):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    got = gm.parallel_groups.from_device_mesh(mesh, COMM, timeout=TIMEOUT)
    assert_torch_groups_match(dist, got, {a: mesh.get_group(a) for a in ("tp", "pp", "dp") if a in names})
    check_against_parallel_groups(got, tensor, pipeline, order)


def test_device_mesh_with_its_own_dimension_names(dist):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    got = gm.parallel_groups.from_device_mesh(mesh, COMM, data="replicate", tensor="shard", timeout=TIMEOUT)
    check_against_parallel_groups(got, 2, 1, "tp-dp-pp")


def test_adopted_groups_drive_a_replica_sampler(dist):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = gm.parallel_groups.from_device_mesh(mesh, COMM, timeout=TIMEOUT)
    replay = gm.Replay(SPEC, 2000, gm.Uniform(), comm=groups.replay_comm("world"), seed=5, timeout=TIMEOUT)
    sampler = gm.ReplicaSampler(replay, groups, timeout=TIMEOUT)
    try:
        insert_random(replay, 6 + RANK, np.random.default_rng(RANK))
        batch = sampler.sample(16, window=4)
        keys = groups.tensor_comm.allgather(batch.keys.numpy().copy())
        assert all(np.array_equal(k, keys[0]) for k in keys)  # the tensor peers hold the same rows
        other = groups.data_comm.allgather(batch.keys.numpy().copy())
        assert not np.array_equal(other[0], other[1])  # the two replicas drew their own
    finally:
        sampler.close()
        replay.close()
        groups.free()


# ---- Megatron-core and DeepSpeed ---------------------------------------------------------------------------

@pytest.mark.parametrize("tensor,pipeline,megatron_order,order", [
    (2, 2, "tp-cp-ep-dp-pp", "tp-dp-pp"),
    (1, 2, "tp-cp-ep-pp-dp", "tp-pp-dp"),
])
def test_megatron_parallel_state_gives_what_parallel_groups_builds(dist, tensor, pipeline, megatron_order, order):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": not needed here
        parallel_state = pytest.importorskip("megatron.core.parallel_state")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor,
                                             pipeline_model_parallel_size=pipeline, order=megatron_order)
    try:
        got = gm.parallel_groups.from_mpu(parallel_state, COMM, timeout=TIMEOUT)
        assert_torch_groups_match(dist, got, {"tp": parallel_state.get_tensor_model_parallel_group(),
                                              "pp": parallel_state.get_pipeline_model_parallel_group(),
                                              "dp": parallel_state.get_data_parallel_group()})
        check_against_parallel_groups(got, tensor, pipeline, order)
    finally:
        parallel_state.destroy_model_parallel()


class _GridMpu:
    """DeepSpeed's PipelineParallelGrid as an mpu: ``get_slice_parallel_group`` is the tensor axis,
    ``get_pipe_parallel_group`` the pipeline, and ``get_model_parallel_group`` spans tensor x pipeline (which
    is no single axis: from_mpu must not take it for the tensor axis)."""

    def __init__(self, groups: dict):
        self.groups = groups

    def get_data_parallel_group(self):
        return self.groups["dp"]

    def get_pipe_parallel_group(self):
        return self.groups["pp"]

    def get_slice_parallel_group(self):
        return self.groups["tp"]

    def get_model_parallel_group(self):
        return self.groups["mp"]


def grid_groups(dist, pipe: int, data: int, model: int) -> dict:
    """DeepSpeed's PipeModelDataParallelTopology: axes pipe, data, model (model fastest); every rank makes every
    group, in the same order, as torch requires."""
    grid = np.arange(SIZE).reshape(pipe, data, model)
    mine = {}
    lines = {"pp": [grid[:, d, m] for d in range(data) for m in range(model)],
             "dp": [grid[p, :, m] for p in range(pipe) for m in range(model)],
             "tp": [grid[p, d, :] for p in range(pipe) for d in range(data)],
             "mp": [grid[:, d, :].reshape(-1) for d in range(data)]}
    for axis, ranks_list in lines.items():
        for ranks in ranks_list:
            g = dist.new_group([int(r) for r in ranks], backend="gloo")
            if RANK in ranks:
                mine[axis] = g
    return mine


@pytest.mark.parametrize("pipe,data,model", [(2, 1, 2), (2, 2, 1)])
def test_deepspeed_style_mpu(dist, pipe, data, model):
    mpu = _GridMpu(grid_groups(dist, pipe, data, model))
    got = gm.parallel_groups.from_mpu(mpu, COMM, timeout=TIMEOUT)
    assert_torch_groups_match(dist, got, mpu.groups)
    check_against_parallel_groups(got, model, pipe, "tp-dp-pp")


# ---- bad input ------------------------------------------------------------------------------------------

def test_bad_input_fails_on_every_rank(dist):
    from torch.distributed.device_mesh import init_device_mesh
    adopt = gm.parallel_groups
    _same_error(lambda: adopt.from_device_mesh(object(), COMM, timeout=TIMEOUT), "expected a torch DeviceMesh")
    cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    _same_error(lambda: adopt.from_device_mesh(cp, COMM, timeout=TIMEOUT), "mesh dimension 'cp' (size 2)")
    _same_error(lambda: adopt.from_device_mesh(cp, COMM, tensor="cp", data="cp", timeout=TIMEOUT),
                "each axis needs its own mesh dimension")

    class NoData:
        def get_tensor_model_parallel_group(self):
            return None
    _same_error(lambda: adopt.from_mpu(NoData(), COMM, timeout=TIMEOUT), "no get_data_parallel_group()")

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    _same_error(lambda: adopt.from_process_groups(tensor=tp, comm=COMM, timeout=TIMEOUT),
                "2 x 1 x 1 = 2 ranks, but the MPI communicator has 4")
    _same_error(lambda: adopt.from_process_groups(tensor=tp, data=tp, comm=COMM, timeout=TIMEOUT),
                "the groups form no 2 x 1 x 2 grid")
    half = COMM.Split(RANK // 2, RANK)  # two communicators of 2 ranks: the mesh spans 4
    try:
        _same_error(lambda: adopt.from_device_mesh(mesh, half, timeout=TIMEOUT), "but the MPI communicator has 2")
    finally:
        half.Free()


def test_mpi_ranks_in_another_order_than_torch_ranks(dist):
    """A communicator whose ranks run opposite to the torch ranks: refused (the layout is no grid of its ranks);
    the communicator reordered by torch rank, as the error says, gives the groups."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reversed_comm = COMM.Split(0, SIZE - 1 - RANK)
    try:
        _same_error(lambda: gm.parallel_groups.from_device_mesh(mesh, reversed_comm, timeout=TIMEOUT),
                    "pass comm=comm.Split(0, key=torch.distributed.get_rank())")
        fixed = reversed_comm.Split(0, key=dist.get_rank())
        try:
            got = gm.parallel_groups.from_device_mesh(mesh, fixed, timeout=TIMEOUT)
            assert got.rank == RANK
            check_against_parallel_groups(got, 2, 1, "tp-dp-pp")
        finally:
            fixed.Free()
    finally:
        reversed_comm.Free()

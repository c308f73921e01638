"""One batch per model replica with the groups a training job already has: a torch DeviceMesh, or Megatron-core's
parallel_state (gm.parallel_groups.from_device_mesh / from_mpu).

    mpiexec -n 4 python -m mpi4py examples/integrations/parallel_frameworks.py                      # DeviceMesh
    mpiexec -n 4 python -m mpi4py examples/integrations/parallel_frameworks.py --framework megatron  # megatron-core

torch.distributed is started over the MPI ranks (gloo, CPU; ``"nccl"`` on GPUs), the framework builds its
2 data-parallel x 2 tensor-parallel layout (``init_device_mesh(..., mesh_dim_names=("dp", "tp"))``, or
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)``), and gear_mpi takes its groups:
the replay lives on the replicas' leaders (``replay_comm("replica")``), each leader samples for its replica and
the ``ReplicaSampler`` hands the same rows to the replica's tensor peers; the reporter sends new priorities.
Prints what each rank received and one ``RESULT`` json line (rank 0).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the ranks share few cores

import argparse
import json
import warnings

import numpy as np
import torch.distributed as dist
from mpi4py import MPI

import gear_mpi as gm


def framework_groups(framework: str, comm) -> tuple[gm.ParallelGroups, object]:
    """The framework's 2 x 2 layout, then gear_mpi's groups read from it; returns (groups, how to tear down)."""
    if framework == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (comm.size // 2, 2), mesh_dim_names=("dp", "tp"))
        return gm.parallel_groups.from_device_mesh(mesh, comm), None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": not needed here
        from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return gm.parallel_groups.from_mpu(parallel_state, comm), parallel_state.destroy_model_parallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", default="mesh", help="mesh, megatron, or both: mesh,megatron")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    gm.init_torch_process_group(comm, "gloo")  # the job's torch.distributed, started over the MPI ranks
    spec = gm.TrajectorySpec({"obs": ((4,), "float32"), "reward": ((), "float32")}, max_length=20)
    summary = {}
    for framework in args.framework.split(","):
        groups, teardown = framework_groups(framework, comm)
        replay_comm = groups.replay_comm("replica")  # the leaders' data-parallel group; None elsewhere
        replay = None
        if replay_comm is not None:
            replay = gm.Replay(spec, 10_000, gm.Prioritized(0.6, 0.4), comm=replay_comm, seed=0)
            rng = np.random.default_rng(groups.data_rank)
            for _ in range(30):
                n = int(rng.integers(5, 21))
                replay.insert({"obs": rng.standard_normal((n, 4)).astype(np.float32),
                               "reward": rng.standard_normal(n).astype(np.float32)})
        sampler = gm.ReplicaSampler(replay, groups, spec=spec)
        agreed = True
        for _ in range(args.steps):
            batch = sampler.sample(32, window=8)
            keys = groups.tensor_comm.allgather(batch.keys.numpy().copy())
            agreed &= all(np.array_equal(k, keys[0]) for k in keys)  # every tensor peer: the same rows
            if groups.is_reporter:
                sampler.update_priorities(batch.keys, np.abs(batch.data["reward"].numpy()).mean(axis=1) + 0.01)
            else:
                sampler.update_priorities()
        print(f"[{framework}] rank {groups.rank}: dp={groups.data_rank} tp={groups.tensor_rank} "
              f"leader={groups.is_leader}, tensor peers {groups.tensor_comm.allgather(groups.rank)}, "
              f"last batch keys {batch.keys.numpy()[:3].tolist()}...", flush=True)
        summary[framework] = {"agreed": bool(comm.allreduce(agreed, op=MPI.LAND)), "order": "-".join(groups.order),
                              "tensor": groups.tensor, "pipeline": groups.pipeline, "data": groups.data}
        sampler.close()
        if replay is not None:
            replay.close()
        groups.free()
        if teardown is not None:
            teardown()
    dist.destroy_process_group()
    if comm.rank == 0:
        print("RESULT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

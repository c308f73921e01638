#!/usr/bin/env python3
"""A small multi-rank replay job: the payload of slurm/replay_sample.sbatch (and its CI test).

Every rank inserts a few trajectories and samples one batch; the number of sampled items
is summed with an MPI allreduce. Each rank prints exactly one line

    rank R of N: sampled K, total T

and rank 0 prints a header first (``slurm_smoke: api=...``). With the distributed
``gm.Replay`` available (``hasattr(gm, "Replay")``), the collective ``Replay.sample`` is
used; otherwise (or with ``--api shard``) each rank samples its own ``gm.Shard``. Every
sampled window is checked: its ``t`` column must be a run of consecutive step numbers of
one inserted trajectory (step numbers encode the inserting rank), padding must be zero.

    srun --mpi=pmi2 -n 2 python -m mpi4py -m scripts.slurm.slurm_smoke --batch-size 8 --window 16
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

STEP_BASE = 1_000_000   # t = (rank * 1000 + trajectory) * STEP_BASE + step


def make_spec(max_length: int) -> gm.TrajectorySpec:
    return gm.TrajectorySpec({"t": ((), "int64"), "obs": ((4,), "float32"), "reward": ((), "float32")},
                             max_length=max_length)


def trajectory(rank: int, i: int, length: int) -> dict[str, np.ndarray]:
    t = (rank * 1000 + i) * STEP_BASE + np.arange(length, dtype=np.int64)
    return {"t": t, "obs": np.repeat(t[:, None].astype(np.float32), 4, axis=1),
            "reward": np.full(length, float(rank), np.float32)}


def check_batch(batch, size: int, window: int, n_ranks: int) -> None:
    t = batch["t"].numpy()
    mask = batch.mask.numpy()
    assert t.shape == (size, window) and mask.shape == (size, window), (t.shape, mask.shape)
    for row in range(size):
        real = t[row][mask[row]]
        assert len(real) >= 1, f"row {row}: empty window"
        assert np.all(np.diff(real) == 1), f"row {row}: steps not consecutive: {real}"
        owner = int(real[0] // STEP_BASE) // 1000
        assert 0 <= owner < n_ranks, f"row {row}: step {real[0]} from no rank"
        assert np.all(t[row][~mask[row]] == 0), f"row {row}: padding not zero"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=("auto", "shard", "replay"), default="auto",
                    help="auto: gm.Replay when gear_mpi has it, else gm.Shard per rank")
    ap.add_argument("--trajectories", type=int, default=6, help="trajectories inserted per rank")
    ap.add_argument("--length", type=int, default=20, help="longest trajectory (lengths vary 5..length)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--capacity-steps", type=int, default=4096, help="steps per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    api = args.api
    if api == "auto":
        api = "replay" if hasattr(gm, "Replay") else "shard"
    if rank == 0:
        print(f"slurm_smoke: api={api} ranks={size} host={socket.gethostname()} "
              f"job={os.environ.get('SLURM_JOB_ID', '-')} python={sys.executable} "
              f"mpi={MPI.Get_library_version().splitlines()[0].strip()}", flush=True)

    spec = make_spec(args.length)
    rng = np.random.default_rng(args.seed + rank)
    lengths = rng.integers(min(5, args.length), args.length + 1, args.trajectories)
    if api == "replay":
        store = gm.Replay(spec, capacity_steps=args.capacity_steps, sampler=gm.Uniform(), comm=comm,
                          seed=args.seed)
    else:
        store = gm.Shard(spec, args.capacity_steps, gm.Uniform(), seed=args.seed + rank, rank=rank)
    try:
        for i, n in enumerate(lengths):
            store.insert(trajectory(rank, i, int(n)), 1.0)
        comm.Barrier()
        batch = store.sample(batch_size=args.batch_size, window=args.window)
        check_batch(batch, args.batch_size, args.window, size)
        k = len(batch)
    finally:
        store.close()
    total = comm.allreduce(k, op=MPI.SUM)
    # one line per rank, in rank order (each rank prints in turn)
    for r in range(size):
        if r == rank:
            print(f"rank {rank} of {size}: sampled {k}, total {total}", flush=True)
        comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
